// torch.ops.tollway_cpu.paged_decode: decode attention reading the paged K/V caches in place.
//
// One task per (sequence, KV head): its G query heads read that head's K and V rows in place through
// the block table (no gather, no copy). Scores for the whole context live in a per-thread buffer
// [G, L] (L = context rounded up to W); softmax and the V sum run over it in fp32. The caches hold
// C: T itself, or a narrower storage type of an fp32 model (`TOLLWAY_KV_CACHE_DTYPE`), widened on load.
//
// The loops keep q and their accumulators in registers: scores four tokens at a time per query head (q's
// D/W vectors loaded once, one horizontal reduction for four dot products), the V sum one query head and
// up to 8 vectors of the row at a time (one pass over the tokens for D <= 8W); K and V rows are re-read
// per query head, from L1/L2, and 16-bit rows widen W values per load (F16C, or a shift for bf16). The
// first version copied every row into a buffer and accumulated V through memory; the second reloaded q
// per row and swept V 2W dims at a time (D / 2W passes): on a 2-core AVX2 host, 30 scattered layers of
// batch 32 x 380 tokens, this one took bf16 from 42 to 33 ms and fp32 from 46 to 40 (ops/bench/RESULTS.md).
//
// The first query head prefetches the K and V rows `kPrefetch` tokens ahead: a sequence's blocks lie
// anywhere in the cache, so the hardware prefetcher loses the stream at every block boundary. On an
// AVX512 host this took the op over 30 scattered layers from 68 to 44 ms in bf16 (ops/bench/paged_decode.py).
#include "paged_decode.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

namespace {

using namespace tollway_native;

#if defined(CPU_CAPABILITY_AVX512)
#define TOLLWAY_BF16_DOT __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

// Whether this CPU has AVX512-BF16 (vdpbf16ps): the library is built for AVX512 alone, so the bf16 dot
// products below are compiled for that extension only and called where it is present.
bool bf16_dot_available() {
  static const bool available = __builtin_cpu_supports("avx512bf16");
  return available;
}

// The scores q . k of n context tokens of one head, bf16 q against a bf16 cache, with AVX512-BF16 dot
// products: each vdpbf16ps multiplies 32 bf16 pairs exactly and sums them in pairs into 16 fp32 lanes,
// replacing the widening of every K row to fp32 and its two multiply-adds. `prefetch`: fetch the K and
// V rows kPrefetch tokens ahead, as the generic loop's first query head does.
template <int64_t D>
TOLLWAY_BF16_DOT void scores_bf16(const BFloat16* q, const BFloat16* kp, const BFloat16* vp, const int64_t* rows,
                                  int64_t n, float* s, bool prefetch) {
  static_assert(D % 32 == 0, "32 bf16 values per vector");
  __m512bh qv[D / 32];
  for (int64_t j = 0; j < D / 32; ++j) qv[j] = (__m512bh)_mm512_loadu_si512(q + 32 * j);
  auto row = [&](int64_t t, int64_t j) { return (__m512bh)_mm512_loadu_si512(kp + rows[t] + 32 * j); };
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    if (prefetch) prefetch_ahead(kp, vp, rows, i, n, D * 2);
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int64_t j = 0; j < D / 32; ++j) {
      a0 = _mm512_dpbf16_ps(a0, qv[j], row(i, j));
      a1 = _mm512_dpbf16_ps(a1, qv[j], row(i + 1, j));
      a2 = _mm512_dpbf16_ps(a2, qv[j], row(i + 2, j));
      a3 = _mm512_dpbf16_ps(a3, qv[j], row(i + 3, j));
    }
    reduce4(Vec(a0), Vec(a1), Vec(a2), Vec(a3), s + i);
  }
  for (; i < n; ++i) {
    __m512 a = _mm512_setzero_ps();
    for (int64_t j = 0; j < D / 32; ++j) a = _mm512_dpbf16_ps(a, qv[j], row(i, j));
    s[i] = _mm512_reduce_add_ps(a);
  }
}
#endif

template <typename T, typename C, int64_t D>
void paged_decode_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& tables, const at::Tensor& lens, double scale, int64_t window,
                       at::Tensor& out) {
  static_assert(D % W == 0, "whole vectors per row");
  constexpr int64_t V = D / W;               // vectors per row: q's stay in registers while scoring
  constexpr int64_t kChunk = V < 8 ? V : 8;  // V-sum accumulators per pass: 8 + a row + p fit AVX2's 16
  const DecodeGeometry geo(q, k_cache, tables, lens, out);
  const int64_t Hkv = geo.Hkv, G = geo.G, L = geo.L;
  const T* qp = q.data_ptr<T>();
  const C* kp = k_cache.data_ptr<C>();
  const C* vp = v_cache.data_ptr<C>();
  T* op = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);
#if defined(CPU_CAPABILITY_AVX512)
  const bool bf16_dot = bf16_dot_available();  // bf16 q and cache: the scores as bf16 dot products
#endif

  at::parallel_for(0, geo.B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(G * L);
    std::vector<int64_t> rows(L);  // element offset of each context token's row for this head
    alignas(64) float qf[D];
    alignas(64) float acc[D];
    Vec qv[V];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, h = task % Hkv;
      const int64_t start = geo.start(b, window);
      const int64_t n = geo.lens[b] - start, n_padded = (n + W - 1) / W * W;
      for (int64_t i = 0; i < n; ++i) {
        rows[i] = geo.row(b, start + i, h);
      }
      for (int64_t g = 0; g < G; ++g) {
        float* s = scores.data() + g * L;
        int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512)
        if constexpr (std::is_same_v<T, BFloat16> && std::is_same_v<C, BFloat16> && D % 32 == 0) {
          if (bf16_dot) {
            scores_bf16<D>(qp + geo.q_offset(b, h * G + g), kp, vp, rows.data(), n, s, g == 0);
            i = n;  // every score done: on to the softmax
          }
        }
#endif
        if (i < n) {
          load_floats(qp + geo.q_offset(b, h * G + g), qf, D);
          for (int64_t j = 0; j < V; ++j) qv[j] = Vec::loadu(qf + j * W);
        }
        for (; i + 4 <= n; i += 4) {  // four dot products, one reduction
          if (g == 0) prefetch_ahead(kp, vp, rows.data(), i, n, D * int64_t(sizeof(C)));
          Vec a0(0.f), a1(0.f), a2(0.f), a3(0.f);
          for (int64_t j = 0; j < V; ++j) {
            a0 = at::vec::fmadd(qv[j], load_vec(kp + rows[i] + j * W), a0);
            a1 = at::vec::fmadd(qv[j], load_vec(kp + rows[i + 1] + j * W), a1);
            a2 = at::vec::fmadd(qv[j], load_vec(kp + rows[i + 2] + j * W), a2);
            a3 = at::vec::fmadd(qv[j], load_vec(kp + rows[i + 3] + j * W), a3);
          }
          reduce4(a0, a1, a2, a3, s + i);
        }
        for (; i < n; ++i) {
          Vec a(0.f);
          for (int64_t j = 0; j < V; ++j) a = at::vec::fmadd(qv[j], load_vec(kp + rows[i] + j * W), a);
          s[i] = reduce_add(a);
        }
        const Vec inv(softmax_in_place(s, n, n_padded, fscale));
        // V sum: kChunk vectors of the row at a time (one pass over the tokens for D <= 8W), in registers
        for (int64_t d = 0; d < D; d += kChunk * W) {
          Vec sum[kChunk];
          for (int64_t j = 0; j < kChunk; ++j) sum[j] = Vec(0.f);
          for (i = 0; i < n; ++i) {
            const Vec p(s[i]);
            const C* row = vp + rows[i] + d;
            for (int64_t j = 0; j < kChunk; ++j) sum[j] = at::vec::fmadd(p, load_vec(row + j * W), sum[j]);
          }
          for (int64_t j = 0; j < kChunk; ++j) (sum[j] * inv).store(acc + d + j * W);
        }
        store_floats(acc, op + geo.out_offset(b, h * G + g), D);
      }
    }
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

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                        int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "paged_decode: bad shapes");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.strides() == k_cache.strides(),
              "paged_decode: head rows must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && kv_pair_ok(q.scalar_type(), k_cache.scalar_type()),
              "paged_decode: the caches must hold q's dtype, fp16/bf16 under an fp32 q, or int8");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt &&
                  block_tables.stride(1) == 1 && context_lens.is_contiguous(),
              "paged_decode: block tables and context lengths must be int32 rows");
  const bool int8_cache = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(q.size(2) + (int8_cache ? kScaleBytes : 0) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0 &&
                  q.size(1) / k_cache.size(2) <= kMaxGroup,
              "paged_decode: need head_dim equal and at most 8 query heads per KV head");
  TORCH_CHECK(block_tables.size(0) >= q.size(0) && context_lens.size(0) >= q.size(0), "paged_decode: batch mismatch");
  at::Tensor out = at::empty(q.sizes(), q.options());
  const at::ScalarType cache = k_cache.scalar_type();
  if (int8_cache) {
    paged_decode_int8(q, k_cache, v_cache, block_tables, context_lens, scale, window, out);
  } else if (q.scalar_type() == at::kFloat && cache == at::kFloat) {
    paged_decode_dispatch_dim<float, float>(q, k_cache, v_cache, block_tables, context_lens, scale, window, out);
  } else if (q.scalar_type() == at::kFloat && cache == at::kHalf) {
    paged_decode_dispatch_dim<float, Half>(q, k_cache, v_cache, block_tables, context_lens, scale, window, out);
  } else if (q.scalar_type() == at::kFloat) {
    paged_decode_dispatch_dim<float, BFloat16>(q, k_cache, v_cache, block_tables, context_lens, scale, window, out);
  } else {
    paged_decode_dispatch_dim<BFloat16, BFloat16>(q, k_cache, v_cache, block_tables, context_lens, scale, window, out);
  }
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
