// The LM head's logits refinement, torch.ops.tollway_cpu.refine_top_logits (workers/models/logits_refine.py):
// logits an approximate head computed (bf16 outputs, or an int8 copy of the weights) turned into fp32, with the
// k largest of each row recomputed in fp32 from the float weight rows. One pass per row replaces torch's
// `.float()`, `topk`, row gather, `einsum` and `scatter_` (about 4 ms of a 45 ms batch-32 decode step).
#include "common.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <utility>
#include <vector>

namespace {

using namespace tollway_native;

// The indices of k largest values of row[0, n) (where values tie at the k-th, any of them), k <= n.
// A min-heap holds the best k so far; a span of 4W values whose maximum does not beat the heap's least
// is passed over with one comparison, so after the first spans nearly every value costs a load and a max.
std::vector<int64_t> top_indices(const float* row, int64_t n, int64_t k) {
  using Entry = std::pair<float, int64_t>;
  auto greater = [](const Entry& a, const Entry& b) { return a.first > b.first; };  // the least on top
  std::vector<Entry> heap;
  heap.reserve(k);
  for (int64_t i = 0; i < k; ++i) heap.emplace_back(row[i], i);
  std::make_heap(heap.begin(), heap.end(), greater);
  float least = heap.front().first;
  auto offer = [&](int64_t i) {
    if (row[i] > least) {
      std::pop_heap(heap.begin(), heap.end(), greater);
      heap.back() = {row[i], i};
      std::push_heap(heap.begin(), heap.end(), greater);
      least = heap.front().first;
    }
  };
  constexpr int64_t span = 4 * W;
  int64_t i = k;
  for (; i + span <= n; i += span) {
    const Vec a = at::vec::maximum(Vec::loadu(row + i), Vec::loadu(row + i + W));
    const Vec b = at::vec::maximum(Vec::loadu(row + i + 2 * W), Vec::loadu(row + i + 3 * W));
    const float most = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); },
                                                      at::vec::maximum(a, b));
    if (most > least) {
      for (int64_t j = i; j < i + span; ++j) offer(j);
    }
  }
  for (; i < n; ++i) offer(i);
  std::vector<int64_t> indices(k);
  for (int64_t j = 0; j < k; ++j) indices[j] = heap[j].second;
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
      for (int64_t v : top_indices(row, V, k)) row[v] = dot(wp + v * H, xp + n * H, H);
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(tollway_cpu, m) {
  m.def("refine_top_logits(Tensor logits, Tensor weight, Tensor normed, int k) -> Tensor");
}

TORCH_LIBRARY_IMPL(tollway_cpu, CPU, m) {
  m.impl("refine_top_logits", &refine_top_logits);
}
