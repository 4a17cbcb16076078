// torch.ops.tollway_cpu.paged_decode: decode attention reading the paged K/V caches in place.
//
// One task per (sequence, KV head): its G query heads read that head's K and V rows in place through
// the block table (no gather, no copy). Scores for the whole context live in a per-thread buffer
// [heads per pass, L] (L = context rounded up to W); softmax and the V sum run over it in fp32. The caches
// hold C: T itself, or a narrower storage type of an fp32 model (`TOLLWAY_KV_CACHE_DTYPE`), widened on load,
// or int8 rows (kernels/kv_int8.py: D codes, then an fp16 scale per 16 of them), each vector of codes widened
// and multiplied by its group's scale as it loads (D + D / 8 bytes read per row; the earlier layout's one scale
// per row was applied to the score and to the probability instead).
//
// The query heads go in passes of up to kHeadsPerPass (AVX512: 4; AVX2: 1, whose 16 registers hold one
// head's q and sums): a pass reads each K row once for its heads (four tokens at a time, one horizontal
// reduction per head and four dot products) and each V row once, its heads' sums in registers (one pass
// over the tokens for D <= 8W). 16-bit rows widen W values per load (F16C, or a shift for bf16). Earlier
// versions: rows copied into a buffer and V accumulated through memory; then q reloaded per row and V
// swept 2W dims at a time; then one head per pass (AVX2 still). One pass for the 3 heads of the default
// model took the op's compute (30 layers, batch 32 x 380 tokens, cache hot) from 9.6 to 6.6 ms in bf16 and
// 15.5 to 10.1 ms in fp32 on a 2-core AVX512 host (ops/bench/RESULTS.md).
//
// A bf16 cache under a bf16 model, where the CPU has AVX512-BF16, takes its products on vdpbf16ps
// (paged_decode_bf16.h): the scores (scores_bf16) and the V sum, two tokens per instruction with the
// probabilities rounded to bf16 (value_sum_bf16): the op's compute over 30 layers at batch 32 x 380 (cache hot)
// 6.4-7.2 -> 5.3-5.7 ms. With enough sequences it runs a task per sequence over its every KV head
// (sequence_task), whose score loop reads each token's whole record: the engine's bf16 decode step at batch
// 32 x 380 went 1.59-1.63x -> 1.56-1.57x its matmuls on a 2-core EPYC (the op alone: contiguous ~8% faster,
// scattered level). Not on every CPU: where bf16_decode_dots() (paged_decode.h) says so, the rows widen to fp32.
//
// Under an fp32 q (or a bf16 q over an int8 cache), rows that are one sequence's consecutive new tokens (a
// prefill chunk sent as decode rows, workers/models/fused_decode.py) go as tiles (paged_prefill.h): per KV head,
// the scores and the V sum of up to 16 tokens' query heads as register-tiled GEMMs over the context's rows. One
// 380-token prompt's attention per layer went 5.3-5.6 -> 2.0 ms on a 2-core AVX2 EPYC (ops/bench/paged_decode.py's
// prefill line; a bf16 q over an int8 cache: ops/bench/RESULTS.md). A bf16 q over a bf16 cache does the same on
// vdpbf16ps where the CPU has AVX512-BF16 (paged_prefill_bf16.h), or on AMX tiles where it has AMX-BF16 and the
// head dim is whole 64s (paged_prefill_amx.h: 395-token prompts' attention 2.7x faster on a 2-core AMX Xeon);
// the rows outside runs then go by sequence or by (row, KV head) as before.
//
// A task's first pass prefetches the K and V rows `kPrefetch` tokens ahead: a sequence's blocks lie
// anywhere in the cache, so the hardware prefetcher loses the stream at every block boundary. On an
// AVX512 host this took the op over 30 scattered layers from 68 to 44 ms in bf16 (ops/bench/paged_decode.py).
// The prefetches go to L2, not L1: L1's few miss buffers held the op to ~8 GB/s a thread (2-core EPYC,
// scattered bf16 24.6 -> 13.5 ms; the AVX2 build's fp32 37.9 -> 26.4 ms). The score loop fetched both K and
// V, and the V sum (reading only rows already in L2) left the memory idle: the V sum now fetches the thread's
// next task's K rows, so each half of a task streams half its bytes while it computes (the engine's bf16
// decode step at batch 32 x 380: 50.6-51.6 -> 46.1-47.4 ms on a 2-core EPYC). Dropping the score loop's K
// prefetch for those rows (already fetched) made scattered caches slower (13.6-15.0 -> 20.7-21.4 ms): kept.
// With three passes or more (AVX2's passes of one head; the default model has 3 query heads a KV head), the passes
// after the first read the task's rows from L2 and leave the memory idle as well: the pass before the last fetches
// the next task's V rows in its V sum and the last pass its K rows, so the next task finds both in L2 (fp32 over
// 30 scattered layers at batch 32 x 380, ten alternations on a 2-core AVX2 EPYC: median 31.1 -> 28.9 ms, 7 of 10
// faster; the engine's step level within its noise).
#include "paged_decode_bf16.h"
#include "paged_prefill.h"
#include "paged_prefill_amx.h"
#include "paged_prefill_bf16.h"
#include "step_ops.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

namespace {

using namespace tollway_native;

// Scores of NG query heads (qf: [NG][D] floats) against the task's K rows: each row is read once for the
// NG heads, four tokens at a time with one reduction per head.
template <typename C, int64_t D, int64_t NG>
void scores_float(const float* qf, TaskRows<C> t) {
  constexpr int64_t V = D / W;
  Vec q[NG][V];  // in registers where they fit (AVX2: one head's 8 vectors), else spilled once
  for (int64_t g = 0; g < NG; ++g) {
    for (int64_t j = 0; j < V; ++j) q[g][j] = Vec::loadu(qf + g * D + j * W);
  }
  int64_t i = 0;
  for (; i + 4 <= t.n; i += 4) {
    if (t.prefetch) prefetch_ahead(t.kp, t.vp, t.rows, i, t.n, row_bytes<C, D>());
    Vec a[NG][4];
    for (int64_t g = 0; g < NG; ++g) a[g][0] = a[g][1] = a[g][2] = a[g][3] = Vec(0.f);
    const C* k0 = t.kp + t.rows[i];
    const C* k1 = t.kp + t.rows[i + 1];
    const C* k2 = t.kp + t.rows[i + 2];
    const C* k3 = t.kp + t.rows[i + 3];
#pragma GCC unroll 16
    for (int64_t j = 0; j < V; ++j) {
      if constexpr (std::is_same_v<C, int8_t>) {  // each vector widened and scaled once for the NG heads
        const Vec v0 = load_row<C, D>(k0, j * W), v1 = load_row<C, D>(k1, j * W);
        const Vec v2 = load_row<C, D>(k2, j * W), v3 = load_row<C, D>(k3, j * W);
#pragma GCC unroll 8
        for (int64_t g = 0; g < NG; ++g) {
          a[g][0] = at::vec::fmadd(q[g][j], v0, a[g][0]);
          a[g][1] = at::vec::fmadd(q[g][j], v1, a[g][1]);
          a[g][2] = at::vec::fmadd(q[g][j], v2, a[g][2]);
          a[g][3] = at::vec::fmadd(q[g][j], v3, a[g][3]);
        }
      } else {
#pragma GCC unroll 8
        for (int64_t g = 0; g < NG; ++g) {  // the loads repeat per head: L1 hits, and fp32 ones fold into the FMA
          a[g][0] = at::vec::fmadd(q[g][j], load_vec(k0 + j * W), a[g][0]);
          a[g][1] = at::vec::fmadd(q[g][j], load_vec(k1 + j * W), a[g][1]);
          a[g][2] = at::vec::fmadd(q[g][j], load_vec(k2 + j * W), a[g][2]);
          a[g][3] = at::vec::fmadd(q[g][j], load_vec(k3 + j * W), a[g][3]);
        }
      }
    }
    for (int64_t g = 0; g < NG; ++g) reduce4(a[g][0], a[g][1], a[g][2], a[g][3], t.s + g * t.L + i);
  }
  for (; i < t.n; ++i) {
    for (int64_t g = 0; g < NG; ++g) {
      Vec a(0.f);
      for (int64_t j = 0; j < V; ++j) a = at::vec::fmadd(q[g][j], load_row<C, D>(t.kp + t.rows[i], j * W), a);
      t.s[g * t.L + i] = reduce_add(a);
    }
  }
}


// out[g] = sum_i p_g[i] v_i * inv[g] for the NG heads of a pass (probabilities in t.s): each V row is read
// once for the NG heads, value_chunk vectors of it per pass over the tokens, the sums in registers.
template <typename C, int64_t D, int64_t NG>
void value_sum(TaskRows<C> t, const float* inv, float* acc) {
  constexpr int64_t V = D / W, K = value_chunk<V, NG>();
  const C* next_base = t.next_v ? t.vp : t.kp;  // whose rows of the next task this V sum fetches
  for (int64_t d = 0; d < D; d += K * W) {
    Vec sum[NG][K];
    for (int64_t g = 0; g < NG; ++g) {
      for (int64_t j = 0; j < K; ++j) sum[g][j] = Vec(0.f);
    }
    const bool fetch_next = d == 0 && t.next_n > 0;
    for (int64_t i = 0; i < t.n; ++i) {
      if (fetch_next && i < t.next_n) prefetch_rows(next_base, t.next_rows, i, i + 1, row_bytes<C, D>());
      Vec p[NG];
      for (int64_t g = 0; g < NG; ++g) p[g] = Vec(t.s[g * t.L + i]);
      const C* row = t.vp + t.rows[i];
#pragma GCC unroll 16
      for (int64_t j = 0; j < K; ++j) {
        const Vec v = load_row<C, D>(row, d + j * W);
#pragma GCC unroll 8
        for (int64_t g = 0; g < NG; ++g) sum[g][j] = at::vec::fmadd(p[g], v, sum[g][j]);
      }
    }
    if (fetch_next) prefetch_rows(next_base, t.next_rows, std::min(t.n, t.next_n), t.next_n, row_bytes<C, D>());
    for (int64_t g = 0; g < NG; ++g) {
      for (int64_t j = 0; j < K; ++j) (sum[g][j] * Vec(inv[g])).store(acc + g * D + d + j * W);
    }
  }
}

// Query heads g0 .. g0 + NG of the task's KV head (b, h): scores, softmax, V sum, stored into out.
// `dots`: a bf16 cache's products on vdpbf16ps (bf16_decode_dots(), taken once per op call).
template <typename T, typename C, int64_t D, int64_t NG>
void heads_pass(const DecodeGeometry& geo, const T* qp, T* op, int64_t b, int64_t h, int64_t g0, float fscale,
                TaskRows<C> t, bool dots) {
  const int64_t first = h * geo.G + g0;  // the pass's first query head
  bool scored = false;
  (void)dots;  // read only where the library is built for AVX512
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, BFloat16> && std::is_same_v<C, BFloat16> && D % 32 == 0) {
    if (dots) {
      scores_bf16<D, NG>(qp + geo.q_offset(b, first), geo.qs1, t);
      scored = true;
    }
  }
#endif
  if (!scored) {
    alignas(64) float qf[NG * D];
    for (int64_t g = 0; g < NG; ++g) load_floats(qp + geo.q_offset(b, first + g), qf + g * D, D);
    scores_float<C, D, NG>(qf, t);
  }
  const int64_t n_padded = (t.n + W - 1) / W * W;
  float inv[NG];
  for (int64_t g = 0; g < NG; ++g) inv[g] = softmax_in_place<std::is_same_v<T, BFloat16>>(t.s + g * t.L, t.n, n_padded, fscale);
  alignas(64) float acc[NG * D];
  bool summed = false;
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, BFloat16> && std::is_same_v<C, BFloat16> && D % 32 == 0) {
    if (dots) {
      value_sum_bf16<D, NG>(t, inv, acc);
      summed = true;
    }
  }
#endif
  if (!summed) value_sum<C, D, NG>(t, inv, acc);
  for (int64_t g = 0; g < NG; ++g) store_floats(acc + g * D, op + geo.out_offset(b, first + g), D);
}


template <typename T, typename C, int64_t D>
void paged_decode_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& tables, const at::Tensor& lens, double scale, int64_t window,
                       at::Tensor& out) {
  static_assert(D % W == 0, "whole vectors per row");
  const DecodeGeometry geo(q, k_cache, tables, lens, out);
  const int64_t Hkv = geo.Hkv, G = geo.G, L = geo.L;
  const T* qp = q.data_ptr<T>();
  const C* kp = k_cache.data_ptr<C>();
  const C* vp = v_cache.data_ptr<C>();
  T* op = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);

  // Rows the per-sequence or per-(row, KV head) tasks below take: all of them, or those left outside prefill
  // runs (as tiles: fp32, or bf16 over a bf16 cache on AVX512-BF16). The fp32 tiles also take a bf16 q over an
  // int8 cache, whose rows they widen to fp32 as its decode rows do (the same arithmetic, tiled).
  constexpr bool fp32_tiles = (std::is_same_v<T, float> || std::is_same_v<C, int8_t>) && D % (2 * W) == 0;
  constexpr bool bf16_dots = std::is_same_v<T, BFloat16> && std::is_same_v<C, BFloat16> && D % 32 == 0;
  std::vector<int64_t> singles;
  bool tiles = fp32_tiles;
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (bf16_dots) tiles = bf16_dot_available();
#endif
  if (tiles) {
    const std::vector<PrefillRun> runs = find_prefill_runs(geo, window, singles);
    if (!runs.empty()) {
      if constexpr (fp32_tiles) prefill_runs<T, C, D>(geo, runs, qp, kp, vp, op, fscale);
#if defined(CPU_CAPABILITY_AVX512)
      if constexpr (bf16_dots && D % 64 == 0) {  // AMX tiles where the CPU has them, else vdpbf16ps
        if (amx_prefill_tiles()) {
          prefill_runs_amx<D>(geo, runs, qp, kp, vp, op, fscale);
        } else {
          prefill_runs_bf16<D>(geo, runs, qp, kp, vp, op, fscale);
        }
      } else if constexpr (bf16_dots) {
        prefill_runs_bf16<D>(geo, runs, qp, kp, vp, op, fscale);
      }
#endif
    }
  } else {
    for (int64_t b = 0; b < geo.B; ++b) singles.push_back(b);
  }
  if (singles.empty()) return;
  bool dots = false;
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (bf16_dots) {
    dots = bf16_decode_dots();
    if (decode_by_sequence<D>(geo, singles, qp, kp, vp, op, fscale, window, dots)) return;
  }
#endif
  // A task per (row, KV head); where there are rows enough to share out, a thread claims a row's heads together.
  const int64_t count = int64_t(singles.size()), unit = count >= 2 * at::get_num_threads() ? Hkv : 1;
  LongestFirst tasks(count * Hkv, [&](int64_t task) { return geo.lens[singles[task / Hkv]]; }, unit);
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> scores(kHeadsPerPass * L);
    ClaimedRows claimed(L);  // element offset of each context token's row for this head, this task's and the next's
    std::vector<BFloat16> probs16(std::is_same_v<C, BFloat16> ? kHeadsPerPass * L : 0);
    // The rows of task `task` (b, h) into `into`: n of them.
    auto task_rows = [&](int64_t task, int64_t* into) {
      const int64_t b = singles[task / Hkv], start = geo.start(b, window), n = geo.lens[b] - start;
      geo.fill_rows(b, task % Hkv, start, n, into);
      return n;
    };
    tasks.run_claimed([&](int64_t task, int64_t next) {
      const int64_t b = singles[task / Hkv], h = task % Hkv;
      const int64_t n = claimed.advance(task, next, task_rows), next_n = claimed.next_n;
      for (int64_t g0 = 0; g0 < G; g0 += kHeadsPerPass) {
        // The last pass's V sum fetches the next task's K rows; the one before it (not the first pass) its V rows.
        const bool last = g0 + kHeadsPerPass >= G, second_last = !last && g0 > 0 && g0 + 2 * kHeadsPerPass >= G;
        const TaskRows<C> t{kp, vp, claimed.rows.data(), n, scores.data(), L, g0 == 0, claimed.next_rows.data(),
                            last || second_last ? next_n : 0, probs16.data(), second_last};
        switch (std::min(kHeadsPerPass, G - g0)) {
          case 1: heads_pass<T, C, D, 1>(geo, qp, op, b, h, g0, fscale, t, dots); break;
#if defined(CPU_CAPABILITY_AVX512)
          case 2: heads_pass<T, C, D, 2>(geo, qp, op, b, h, g0, fscale, t, dots); break;
          case 3: heads_pass<T, C, D, 3>(geo, qp, op, b, h, g0, fscale, t, dots); break;
          case 4: heads_pass<T, C, D, 4>(geo, qp, op, b, h, g0, fscale, t, dots); break;
#endif
        }
      }
    });
  });
}

template <typename T, typename C>
void paged_decode_dispatch_dim(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& t,
                               const at::Tensor& l, double scale, int64_t window, at::Tensor& out) {
  switch (q.size(2)) {
    case 16: return paged_decode_impl<T, C, 16>(q, k, v, t, l, scale, window, out);
    case 32: return paged_decode_impl<T, C, 32>(q, k, v, t, l, scale, window, out);
    case 64: return paged_decode_impl<T, C, 64>(q, k, v, t, l, scale, window, out);
    case 128: return paged_decode_impl<T, C, 128>(q, k, v, t, l, scale, window, out);
    case 256: return paged_decode_impl<T, C, 256>(q, k, v, t, l, scale, window, out);
    default: TORCH_CHECK(false, "paged_decode: head_dim must be 16, 32, 64, 128 or 256, got ", q.size(2));
  }
}

}  // namespace

void tollway_native::paged_decode_out(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                      const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                                      int64_t window, at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "paged_decode: bad shapes");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.strides() == k_cache.strides(),
              "paged_decode: head rows must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && kv_pair_ok(q.scalar_type(), k_cache.scalar_type()),
              "paged_decode: the caches must hold q's dtype, fp16/bf16 under an fp32 q, or int8");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt &&
                  block_tables.stride(1) == 1 && context_lens.is_contiguous(),
              "paged_decode: block tables and context lengths must be int32 rows");
  const bool int8_cache = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK((int8_cache ? int8_row_bytes(q.size(2)) : q.size(2)) == k_cache.size(3) &&
                  (!int8_cache || q.size(2) % kGroup == 0) && q.size(1) % k_cache.size(2) == 0 &&
                  q.size(1) / k_cache.size(2) <= kMaxGroup,
              "paged_decode: need head_dim equal (int8 rows: D + D / 8) and at most 8 query heads per KV head");
  TORCH_CHECK(block_tables.size(0) >= q.size(0) && context_lens.size(0) >= q.size(0), "paged_decode: batch mismatch");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type(),
              "paged_decode: the output must be a contiguous tensor shaped as q, in q's dtype");
  const at::ScalarType cache = k_cache.scalar_type();
  if (int8_cache && q.scalar_type() == at::kFloat) {
    paged_decode_dispatch_dim<float, int8_t>(q, k_cache, v_cache, block_tables, context_lens, scale, window, out);
  } else if (int8_cache) {
    paged_decode_dispatch_dim<BFloat16, int8_t>(q, k_cache, v_cache, block_tables, context_lens, scale, window, out);
  } else if (q.scalar_type() == at::kFloat && cache == at::kFloat) {
    paged_decode_dispatch_dim<float, float>(q, k_cache, v_cache, block_tables, context_lens, scale, window, out);
  } else if (q.scalar_type() == at::kFloat && cache == at::kHalf) {
    paged_decode_dispatch_dim<float, Half>(q, k_cache, v_cache, block_tables, context_lens, scale, window, out);
  } else if (q.scalar_type() == at::kFloat) {
    paged_decode_dispatch_dim<float, BFloat16>(q, k_cache, v_cache, block_tables, context_lens, scale, window, out);
  } else {
    paged_decode_dispatch_dim<BFloat16, BFloat16>(q, k_cache, v_cache, block_tables, context_lens, scale, window, out);
  }
}

namespace {

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                        int64_t window) {
  at::Tensor out = at::empty(q.sizes(), q.options());
  tollway_native::paged_decode_out(q, k_cache, v_cache, block_tables, context_lens, scale, window, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tollway_cpu, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, "
        "float scale, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(tollway_cpu, CPU, m) {
  m.impl("paged_decode", &paged_decode);
}
