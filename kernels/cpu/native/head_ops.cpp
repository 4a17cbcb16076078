// The LM head's logits refinement, torch.ops.tollway_cpu.refine_top_logits (workers/models/logits_refine.py),
// the final norm's two outputs before the head, torch.ops.tollway_cpu.rms_norm_pair (workers/models/llama.py),
// and the sampler's greedy choice, torch.ops.tollway_cpu.row_argmax (workers/engine/sampler.py).
// The refinement:
// logits an approximate head computed (bf16 outputs, or an int8 copy of the weights) turned into fp32, with the
// k largest of each row recomputed in fp32 from the float weight rows. One pass per row replaces torch's
// `.float()`, `topk`, row gather, `einsum` and `scatter_` (about 4 ms of a 45 ms batch-32 decode step).
#include "common.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

namespace {

using namespace tollway_native;

// The indices of k largest values of row[0, n) (where values tie at the k-th, any of them), k <= n.
// A threshold first: the k-th largest of the maxima of spans of 4W values. At least k values (one in each of
// those spans) reach it, so the k largest are among the values that do: few (~2k on logits), gathered from the
// spans whose maximum reaches it, and the k largest of those picked. Two passes of loads and maxima over the
// row; a min-heap over every value (the earlier version) spent ~4x as long in its inserts.
std::vector<int64_t> top_indices(const float* row, int64_t n, int64_t k) {
  using Entry = std::pair<float, int64_t>;
  constexpr int64_t span = 4 * W;
  const int64_t spans = n / span;
  auto by_value = [](const Entry& a, const Entry& b) { return a.first > b.first; };
  // NaN ranks below -inf: a strict order for nth_element (NaN logits are a model's failure; never picked here).
  auto ranked = [](float v) { return std::isnan(v) ? -std::numeric_limits<float>::infinity() : v; };
  std::vector<Entry> candidates;
  if (spans >= k) {
    std::vector<float> maxima(spans);
    for (int64_t s = 0; s < spans; ++s) {
      const float* p = row + s * span;
      const Vec a = at::vec::maximum(Vec::loadu(p), Vec::loadu(p + W));
      const Vec b = at::vec::maximum(Vec::loadu(p + 2 * W), Vec::loadu(p + 3 * W));
      const float most = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); },
                                                        at::vec::maximum(a, b));
      maxima[s] = std::isnan(most) ? std::numeric_limits<float>::infinity() : most;  // a span with a NaN: scanned
    }
    std::vector<float> order(maxima);
    std::nth_element(order.begin(), order.begin() + (k - 1), order.end(), std::greater<float>());
    const float threshold = order[k - 1];
    for (int64_t s = 0; s < spans; ++s) {
      if (!(maxima[s] >= threshold)) continue;
      for (int64_t i = s * span; i < (s + 1) * span; ++i) {
        if (row[i] >= threshold) candidates.emplace_back(row[i], i);
      }
    }
    for (int64_t i = spans * span; i < n; ++i) {  // the tail past the last whole span
      if (row[i] >= threshold) candidates.emplace_back(row[i], i);
    }
  }
  if (static_cast<int64_t>(candidates.size()) < k) {  // a short row (or NaNs): every value is a candidate
    candidates.clear();
    for (int64_t i = 0; i < n; ++i) candidates.emplace_back(ranked(row[i]), i);
  }
  std::nth_element(candidates.begin(), candidates.begin() + (k - 1), candidates.end(), by_value);
  std::vector<int64_t> indices(k);
  for (int64_t j = 0; j < k; ++j) indices[j] = candidates[j].second;
  return indices;
}

// sum over h of w[h] * x[h] in fp32 (w fp32 or bf16).
template <typename T>
float dot(const T* w, const float* x, int64_t n) {
  Vec acc(0.f);
  int64_t h = 0;
  for (; h + W <= n; h += W) acc = at::vec::fmadd(load_vec(w + h), Vec::loadu(x + h), acc);
  float sum = reduce_add(acc);
  for (; h < n; ++h) sum += static_cast<float>(w[h]) * x[h];
  return sum;
}

template <typename L, typename T>
void refine_rows(const at::Tensor& logits, const at::Tensor& weight, const at::Tensor& normed, at::Tensor& out,
                 int64_t k) {
  const int64_t N = logits.size(0), V = logits.size(1), H = weight.size(1);
  const L* lp = logits.data_ptr<L>();
  const T* wp = weight.data_ptr<T>();
  const float* xp = normed.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      float* row = op + n * V;
      load_floats(lp + n * V, row, V);
      const std::vector<int64_t> top = top_indices(row, V, k);
      // The k weight rows lie anywhere in the head (~1 KiB each): fetched all at once, not each on its dot's
      // demand (a cold head: the op at batch 32 1.46 -> 0.84-0.88 ms on a 2-core EPYC).
      for (int64_t v : top) {
        const char* p = reinterpret_cast<const char*>(wp + v * H);
        for (int64_t byte = 0; byte < H * int64_t(sizeof(T)); byte += 64) __builtin_prefetch(p + byte, 0, 2);
      }
      for (int64_t v : top) row[v] = dot(wp + v * H, xp + n * H, H);
    }
  });
}

at::Tensor refine_top_logits(const at::Tensor& logits, const at::Tensor& weight, const at::Tensor& normed,
                             int64_t k) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() &&
                  (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16),
              "refine_top_logits: logits must be a contiguous fp32 or bf16 [N, V]");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.size(0) == logits.size(1) &&
                  (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16),
              "refine_top_logits: weight must be a contiguous fp32 or bf16 [V, H]");
  TORCH_CHECK(normed.dim() == 2 && normed.is_contiguous() && normed.scalar_type() == at::kFloat &&
                  normed.size(0) == logits.size(0) && normed.size(1) == weight.size(1),
              "refine_top_logits: normed must be a contiguous fp32 [N, H]");
  TORCH_CHECK(k >= 1 && k <= logits.size(1), "refine_top_logits: k must be in [1, V]");
  at::Tensor out = at::empty(logits.sizes(), logits.options().dtype(at::kFloat));
  const bool bf16_logits = logits.scalar_type() == at::kBFloat16;
  if (weight.scalar_type() == at::kFloat) {
    if (bf16_logits) refine_rows<BFloat16, float>(logits, weight, normed, out, k);
    else refine_rows<float, float>(logits, weight, normed, out, k);
  } else {
    if (bf16_logits) refine_rows<BFloat16, BFloat16>(logits, weight, normed, out, k);
    else refine_rows<float, BFloat16>(logits, weight, normed, out, k);
  }
  return out;
}

// hidden [N, H] fp32 -> (normed, exact): normed = weight * unit rounded to the weight's dtype (the head's input,
// as `weight * unit.to(weight.dtype)`), exact = unit * weight in fp32 (the refined logits' input,
// workers/models/logits_refine.py), unit = hidden / rms(hidden) in fp32. In torch ops (F.rms_norm, two
// multiplies and their casts) this took ~0.45 ms of a bf16 batch-32 decode step on a 2-core Zen 4, one thread
// working; unit's sum of squares runs in another order than F.rms_norm's, so the two differ in fp32's last bits.
template <typename T>
void rms_norm_pair_impl(const at::Tensor& hidden, const at::Tensor& weight, double eps, at::Tensor& normed,
                        at::Tensor& exact) {
  const int64_t N = hidden.size(0), H = hidden.size(1);
  const float* hp = hidden.data_ptr<float>();
  const T* wp = weight.data_ptr<T>();
  T* np = normed.data_ptr<T>();
  float* ep = exact.data_ptr<float>();
  at::parallel_for(0, N, 8, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float* r = hp + n * H;
      const float inv = inverse_rms(r, H, eps);
      int64_t i = 0;
      for (; i + W <= H; i += W) {  // the scalar loop below, W lanes at a time (the same roundings)
        const Vec unit = Vec::loadu(r + i) * Vec(inv), w = load_vec(wp + i);
        store_vec(w * round_vec<T>(unit), np + n * H + i);
        (unit * w).store(ep + n * H + i);
      }
      for (; i < H; ++i) {
        const float unit = r[i] * inv, w = static_cast<float>(wp[i]);
        np[n * H + i] = T(w * round_to<T>(unit));
        ep[n * H + i] = unit * w;
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> rms_norm_pair(const at::Tensor& hidden, const at::Tensor& weight, double eps) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous() && hidden.scalar_type() == at::kFloat,
              "rms_norm_pair: hidden must be a contiguous fp32 [N, H]");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == hidden.size(1) &&
                  (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16),
              "rms_norm_pair: weight must be an fp32 or bf16 [H]");
  at::Tensor normed = at::empty(hidden.sizes(), weight.options());
  at::Tensor exact = at::empty(hidden.sizes(), hidden.options());
  if (weight.scalar_type() == at::kFloat) {
    rms_norm_pair_impl<float>(hidden, weight, eps, normed, exact);
  } else {
    rms_norm_pair_impl<BFloat16>(hidden, weight, eps, normed, exact);
  }
  return {normed, exact};
}

// Each row's first index of its maximum (of its first NaN, where it has one: torch.max's answer) -> [N] int64.
// One vectorized pass for the maximum, one to find it. torch's `max(dim=-1)` over a batch-32 decode step's
// fp32 logits took ~0.7 ms of a 50 ms step on a 2-core EPYC; the sampler's greedy choice calls this instead.
at::Tensor row_argmax(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == at::kFloat &&
                  logits.size(1) > 0,
              "row_argmax: logits must be a contiguous fp32 [N, V] with V > 0");
  const int64_t N = logits.size(0), V = logits.size(1);
  at::Tensor out = at::empty({N}, logits.options().dtype(at::kLong));
  const float* lp = logits.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float* row = lp + n * V;
      int64_t i = 0;
      Vec most(-std::numeric_limits<float>::infinity());
      for (; i + W <= V; i += W) most = at::vec::maximum(most, Vec::loadu(row + i));  // NaN propagates
      float best = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, most);
      for (; i < V; ++i) {
        if (!std::isnan(best) && (std::isnan(row[i]) || row[i] > best)) best = row[i];
      }
      int64_t found = V - 1;
      if (std::isnan(best)) {
        for (i = 0; i < V && !std::isnan(row[i]); ++i) {
        }
        found = i;
      } else {
        for (i = 0; i + W <= V; i += W) {
          const int equal = ~(Vec::loadu(row + i) == Vec(best)).zero_mask() & ((1 << W) - 1);
          if (equal != 0) break;
        }
        for (; i < V && row[i] != best; ++i) {
        }
        found = i;
      }
      op[n] = found;
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tollway_cpu, m) {
  m.def("refine_top_logits(Tensor logits, Tensor weight, Tensor normed, int k) -> Tensor");
  m.def("row_argmax(Tensor logits) -> Tensor");
  m.def("rms_norm_pair(Tensor hidden, Tensor weight, float eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tollway_cpu, CPU, m) {
  m.impl("refine_top_logits", &refine_top_logits);
  m.impl("row_argmax", &row_argmax);
  m.impl("rms_norm_pair", &rms_norm_pair);
}
