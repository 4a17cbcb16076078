// tollway's native CPU ops for the decode step, registered as torch.ops.tollway_cpu.*.
//
// Built by kernels/cpu/native/build.py with AVX2 or AVX512 flags (CPU_CAPABILITY_* selects ATen's
// Vectorized<float> width W = 8 or 16). Shapes follow kernels/reference.py:
//   K/V cache per layer [num_blocks, block_size, Hkv, D] (rows of one token contiguous: stride(3) == 1);
//   an int8 cache's rows are D codes and their fp32 scale, [.., D + 4] (kernels/kv_int8.py);
//   block_tables [B, max_blocks] int32, context_lens [B] int32 (tokens held, the new one included).
// Every op computes in fp32 and rounds to the tensor dtype (fp32 or bf16) where torch's eager ops
// of the Python path round, so fp32 results match that path to the last bits or nearly.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <tuple>
#include <cmath>
#include <limits>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

namespace {

using at::BFloat16;
using at::Half;
using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();
constexpr int64_t kMaxGroup = 8;
constexpr int64_t kPrefetch = 16;  // paged_decode: tokens ahead whose K/V rows are prefetched

inline float reduce_add(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

// n floats from src (fp32, bf16 or fp16) into dst; n is a multiple of 2 * W, or below it (a head dim
// of 16 under AVX512): then one value at a time.
template <typename T>
inline void load_floats(const T* src, float* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::copy(src, src + n, dst);
  } else if (n < 2 * W) {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
  } else {
    for (int64_t i = 0; i < n; i += 2 * W) {
      auto [lo, hi] = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(src + i));
      lo.store(dst + i);
      hi.store(dst + i + W);
    }
  }
}

// Any n: vector body, scalar tail (c10's BFloat16 and Half round to nearest even, as torch does).
template <typename T>
inline void store_floats(const float* src, T* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::copy(src, src + n, dst);
  } else {
    int64_t i = 0;
    for (; i + 2 * W <= n; i += 2 * W) {
      at::vec::convert_from_float<T>(Vec::loadu(src + i), Vec::loadu(src + i + W)).store(dst + i);
    }
    for (; i < n; ++i) dst[i] = T(src[i]);
  }
}

// x rounded to T and back (identity for fp32): where torch's eager path stores an intermediate.
template <typename T>
inline float round_to(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    return static_cast<float>(BFloat16(x));
  }
}

// The (compute dtype, cache dtype) pairs the attention ops take: fp32 or bf16 caches of their own
// dtype, fp16 or bf16 caches under fp32 compute, and int8 caches (codes + a scale per row) under either.
inline bool kv_pair_ok(at::ScalarType compute, at::ScalarType cache) {
  if (cache == at::kChar) return compute == at::kFloat || compute == at::kBFloat16;
  if (compute == at::kFloat) return cache == at::kFloat || cache == at::kHalf || cache == at::kBFloat16;
  return compute == at::kBFloat16 && cache == at::kBFloat16;
}

// ---- the int8 KV cache (kernels/kv_int8.py) ---------------------------------------------------
// A row of one token and head: D int8 codes, then the fp32 scale s (4 bytes); value = code * s.
constexpr int64_t kScaleBytes = 4;

inline float row_scale(const int8_t* row, int64_t D) {
  float s;
  std::memcpy(&s, row + D, sizeof(float));
  return s;
}

// W codes from p as floats.
inline Vec load_codes(const int8_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
  return Vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(CPU_CAPABILITY_AVX2)
  return Vec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else
  alignas(64) float f[W];
  for (int64_t i = 0; i < W; ++i) f[i] = static_cast<float>(p[i]);
  return Vec::loadu(f);
#endif
}

// x (D values of T) into an int8 row: s = max|x| / 127, codes round(x / s) (to nearest even, as torch.round),
// computed in fp32 exactly as kv_int8.quantize does, so either path stores the same bytes.
template <typename T>
inline void quantize_row(const T* x, int8_t* dst, int64_t D) {
  float amax = 0.f;
  for (int64_t i = 0; i < D; ++i) amax = std::max(amax, std::abs(static_cast<float>(x[i])));
  const float scale = amax / 127.f;
  const float inverse = amax > 0.f ? 1.f / scale : 0.f;
  for (int64_t i = 0; i < D; ++i) {
    const float code = std::nearbyint(static_cast<float>(x[i]) * inverse);
    dst[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, code)));
  }
  std::memcpy(dst + D, &scale, sizeof(float));
}

// Scores s[0, n) scaled by fscale, then softmaxed in place over n_padded lanes (the padding set to
// exp(-inf) = 0); returns 1 / (sum of the exponentials), which the V sum multiplies by.
inline float softmax_in_place(float* s, int64_t n, int64_t n_padded, float fscale) {
  Vec m(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < n; ++i) s[i] *= fscale;
  std::fill(s + n, s + n_padded, -std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < n_padded; i += W) m = at::vec::maximum(m, Vec::loadu(s + i));
  const Vec row_max(at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, m));
  Vec sum(0.f);
  for (int64_t i = 0; i < n_padded; i += W) {
    const Vec p = (Vec::loadu(s + i) - row_max).exp();
    p.store(s + i);
    sum = sum + p;
  }
  return 1.f / reduce_add(sum);
}

// ---- paged decode attention ------------------------------------------------------------------
// One task per (sequence, KV head): its G query heads read that head's K and V rows in place through
// the block table (no gather, no copy). Scores for the whole context live in a per-thread buffer
// [G, L] (L = context rounded up to W); softmax and the V sum run over it in fp32. The caches hold
// C: T itself, or a narrower storage type of an fp32 model (`TOLLWAY_KV_CACHE_DTYPE`), widened on load.
//
// The loops keep their accumulators in registers: scores four tokens at a time per query head (one
// horizontal reduction for four dot products), the V sum one query head and 2W dims at a time over
// the tokens; K and V rows are re-read per query head, from L1/L2. The first version copied every
// row into a buffer and accumulated V through memory: on a 2-core AVX2 host (fp32, batch 32 x 380
// tokens, 30 layers' caches) this one takes 2/3 of its time (ops/bench/RESULTS.md, issue 21).
//
// The first query head prefetches the K and V rows `kPrefetch` tokens ahead: a sequence's blocks lie
// anywhere in the cache, so the hardware prefetcher loses the stream at every block boundary. On an
// AVX512 host this took the op over 30 scattered layers from 68 to 44 ms in bf16 (ops/bench/paged_decode.py).

// Two float vectors (2W values) of a row of C from p; n_valid: W when the row holds fewer than 2W.
template <typename C>
inline void load_pair(const C* p, Vec& lo, Vec& hi, int64_t n_valid) {
  if constexpr (std::is_same_v<C, float>) {
    lo = Vec::loadu(p);
    hi = n_valid > W ? Vec::loadu(p + W) : Vec(0.f);
  } else if (n_valid > W) {
    std::tie(lo, hi) = at::vec::convert_to_float<C>(at::vec::Vectorized<C>::loadu(p));
  } else {
    std::tie(lo, hi) = at::vec::convert_to_float<C>(at::vec::Vectorized<C>::loadu(p, W));
  }
}

// The four horizontal sums of a0..a3, in order.
inline void reduce4(const Vec& a0, const Vec& a1, const Vec& a2, const Vec& a3, float* out) {
#if defined(CPU_CAPABILITY_AVX512)
  auto half = [](const Vec& v) {
    const __m512 x = v;
    return _mm256_add_ps(_mm512_castps512_ps256(x), _mm512_extractf32x8_ps(x, 1));
  };
  const __m256 b0 = half(a0), b1 = half(a1), b2 = half(a2), b3 = half(a3);
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256 b0 = a0, b1 = a1, b2 = a2, b3 = a3;
#endif
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(b0, b1), _mm256_hadd_ps(b2, b3));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
#else
  out[0] = reduce_add(a0), out[1] = reduce_add(a1), out[2] = reduce_add(a2), out[3] = reduce_add(a3);
#endif
}

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
    if (prefetch) {
      for (int64_t t = i + kPrefetch; t < std::min(i + kPrefetch + 4, n); ++t) {
        for (int64_t byte = 0; byte < D * 2; byte += 64) {
          __builtin_prefetch(reinterpret_cast<const char*>(kp + rows[t]) + byte, 0, 3);
          __builtin_prefetch(reinterpret_cast<const char*>(vp + rows[t]) + byte, 0, 3);
        }
      }
    }
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

// What both paged_decode kernels read of their arguments: shapes, strides, the tables and lengths, and
// L, the longest context rounded up to whole vectors (the scores' row length per query head).
struct DecodeGeometry {
  int64_t B, Hkv, BS, G, qs0, qs1, os0, os1, cs0, cs1, cs2, ts0, L;
  const int32_t* tables;
  const int32_t* lens;

  DecodeGeometry(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& tables_, const at::Tensor& lens_,
                 const at::Tensor& out)
      : B(q.size(0)), Hkv(k_cache.size(2)), BS(k_cache.size(1)), G(q.size(1) / k_cache.size(2)), qs0(q.stride(0)),
        qs1(q.stride(1)), os0(out.stride(0)), os1(out.stride(1)), cs0(k_cache.stride(0)), cs1(k_cache.stride(1)),
        cs2(k_cache.stride(2)), ts0(tables_.stride(0)), tables(tables_.data_ptr<int32_t>()),
        lens(lens_.data_ptr<int32_t>()) {
    int64_t max_len = 1;
    for (int64_t b = 0; b < B; ++b) max_len = std::max<int64_t>(max_len, lens[b]);
    L = (max_len + W - 1) / W * W;
  }
  // The first token sequence b attends to (where its window starts; 0 without one).
  int64_t start(int64_t b, int64_t window) const { return window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0; }
  // The offset, in cache elements, of token t's row for KV head h of sequence b.
  int64_t row(int64_t b, int64_t t, int64_t h) const {
    return int64_t(tables[b * ts0 + t / BS]) * cs0 + (t % BS) * cs1 + h * cs2;
  }
  int64_t q_offset(int64_t b, int64_t head) const { return b * qs0 + head * qs1; }
  int64_t out_offset(int64_t b, int64_t head) const { return b * os0 + head * os1; }
};

template <typename T, typename C, int64_t D>
void paged_decode_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& tables, const at::Tensor& lens, double scale, int64_t window,
                       at::Tensor& out) {
  constexpr int64_t P = D < 2 * W ? W : 2 * W;  // floats per load_pair (the row's values it covers)
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
        if (i < n) load_floats(qp + geo.q_offset(b, h * G + g), qf, D);
        for (; i + 4 <= n; i += 4) {  // four dot products, one reduction
          if (g == 0) {  // the first head fetches K and V rows kPrefetch tokens ahead (blocks are scattered)
            for (int64_t t = i + kPrefetch; t < std::min(i + kPrefetch + 4, n); ++t) {
              for (int64_t byte = 0; byte < D * int64_t(sizeof(C)); byte += 64) {
                __builtin_prefetch(reinterpret_cast<const char*>(kp + rows[t]) + byte, 0, 3);
                __builtin_prefetch(reinterpret_cast<const char*>(vp + rows[t]) + byte, 0, 3);
              }
            }
          }
          Vec a0(0.f), a1(0.f), a2(0.f), a3(0.f), lo, hi;
          for (int64_t d = 0; d < D; d += P) {
            const Vec q0 = Vec::loadu(qf + d), q1 = P > W ? Vec::loadu(qf + d + W) : Vec(0.f);
            load_pair(kp + rows[i] + d, lo, hi, P);
            a0 = at::vec::fmadd(q1, hi, at::vec::fmadd(q0, lo, a0));
            load_pair(kp + rows[i + 1] + d, lo, hi, P);
            a1 = at::vec::fmadd(q1, hi, at::vec::fmadd(q0, lo, a1));
            load_pair(kp + rows[i + 2] + d, lo, hi, P);
            a2 = at::vec::fmadd(q1, hi, at::vec::fmadd(q0, lo, a2));
            load_pair(kp + rows[i + 3] + d, lo, hi, P);
            a3 = at::vec::fmadd(q1, hi, at::vec::fmadd(q0, lo, a3));
          }
          reduce4(a0, a1, a2, a3, s + i);
        }
        for (; i < n; ++i) {
          Vec a(0.f), lo, hi;
          for (int64_t d = 0; d < D; d += P) {
            load_pair(kp + rows[i] + d, lo, hi, P);
            a = at::vec::fmadd(P > W ? Vec::loadu(qf + d + W) : Vec(0.f), hi, at::vec::fmadd(Vec::loadu(qf + d), lo, a));
          }
          s[i] = reduce_add(a);
        }
        const Vec inv(softmax_in_place(s, n, n_padded, fscale));
        // V sum: 2W dims at a time, accumulated in registers over the tokens
        for (int64_t d = 0; d < D; d += P) {
          Vec v0(0.f), v1(0.f), lo, hi;
          for (i = 0; i < n; ++i) {
            const Vec p(s[i]);
            load_pair(vp + rows[i] + d, lo, hi, P);
            v0 = at::vec::fmadd(p, lo, v0);
            v1 = at::vec::fmadd(p, hi, v1);
          }
          (v0 * inv).store(acc + d);
          if (P > W) (v1 * inv).store(acc + d + W);
        }
        store_floats(acc, op + geo.out_offset(b, h * G + g), D);
      }
    }
  });
}

// paged_decode over an int8 cache: the same tasks as above; a row's D codes are widened W at a time and
// its scale applied once per row (to the score after the dot product, to the probability before the V
// sum), so the K and V bytes read per token and head are D + 4 instead of 2D or 4D.
template <typename T, int64_t D>
void paged_decode_int8_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& tables, const at::Tensor& lens, double scale, int64_t window,
                            at::Tensor& out) {
  static_assert(D % W == 0, "whole vectors of codes per row");
  constexpr int64_t V = D / W;  // vectors per row
  const DecodeGeometry geo(q, k_cache, tables, lens, out);
  const int64_t Hkv = geo.Hkv, G = geo.G, L = geo.L;
  const T* qp = q.data_ptr<T>();
  const int8_t* kp = k_cache.data_ptr<int8_t>();
  const int8_t* vp = v_cache.data_ptr<int8_t>();
  T* op = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, geo.B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(G * L);
    std::vector<int64_t> rows(L);  // byte offset of each context token's row for this head
    std::vector<float> k_scales(L), v_scales(L);
    alignas(64) float qf[D];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, h = task % Hkv;
      const int64_t start = geo.start(b, window);
      const int64_t n = geo.lens[b] - start, n_padded = (n + W - 1) / W * W;
      for (int64_t i = 0; i < n; ++i) {
        rows[i] = geo.row(b, start + i, h);
        k_scales[i] = row_scale(kp + rows[i], D);
        v_scales[i] = row_scale(vp + rows[i], D);
      }
      for (int64_t g = 0; g < G; ++g) {
        float* s = scores.data() + g * L;
        load_floats(qp + geo.q_offset(b, h * G + g), qf, D);
        Vec qv[V];
        for (int64_t j = 0; j < V; ++j) qv[j] = Vec::loadu(qf + j * W);
        int64_t i = 0;
        for (; i + 4 <= n; i += 4) {  // four dot products, one reduction
          if (g == 0) {
            for (int64_t t = i + kPrefetch; t < std::min(i + kPrefetch + 4, n); ++t) {
              for (int64_t byte = 0; byte < D + kScaleBytes; byte += 64) {
                __builtin_prefetch(kp + rows[t] + byte, 0, 3);
                __builtin_prefetch(vp + rows[t] + byte, 0, 3);
              }
            }
          }
          Vec a0(0.f), a1(0.f), a2(0.f), a3(0.f);
          for (int64_t j = 0; j < V; ++j) {
            a0 = at::vec::fmadd(qv[j], load_codes(kp + rows[i] + j * W), a0);
            a1 = at::vec::fmadd(qv[j], load_codes(kp + rows[i + 1] + j * W), a1);
            a2 = at::vec::fmadd(qv[j], load_codes(kp + rows[i + 2] + j * W), a2);
            a3 = at::vec::fmadd(qv[j], load_codes(kp + rows[i + 3] + j * W), a3);
          }
          reduce4(a0, a1, a2, a3, s + i);
          for (int64_t t = i; t < i + 4; ++t) s[t] *= k_scales[t];
        }
        for (; i < n; ++i) {
          Vec a(0.f);
          for (int64_t j = 0; j < V; ++j) a = at::vec::fmadd(qv[j], load_codes(kp + rows[i] + j * W), a);
          s[i] = reduce_add(a) * k_scales[i];
        }
        const Vec inv(softmax_in_place(s, n, n_padded, fscale));
        Vec acc[V];
        for (int64_t j = 0; j < V; ++j) acc[j] = Vec(0.f);
        for (i = 0; i < n; ++i) {
          const Vec p(s[i] * v_scales[i]);
          for (int64_t j = 0; j < V; ++j) acc[j] = at::vec::fmadd(p, load_codes(vp + rows[i] + j * W), acc[j]);
        }
        alignas(64) float result[D];
        for (int64_t j = 0; j < V; ++j) (acc[j] * inv).store(result + j * W);
        store_floats(result, op + geo.out_offset(b, h * G + g), D);
      }
    }
  });
}

template <typename T>
void paged_decode_int8_dispatch_dim(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& t,
                                    const at::Tensor& l, double scale, int64_t window, at::Tensor& out) {
  switch (q.size(2)) {
    case 16: return paged_decode_int8_impl<T, 16>(q, k, v, t, l, scale, window, out);
    case 32: return paged_decode_int8_impl<T, 32>(q, k, v, t, l, scale, window, out);
    case 64: return paged_decode_int8_impl<T, 64>(q, k, v, t, l, scale, window, out);
    case 128: return paged_decode_int8_impl<T, 128>(q, k, v, t, l, scale, window, out);
    case 256: return paged_decode_int8_impl<T, 256>(q, k, v, t, l, scale, window, out);
    default: TORCH_CHECK(false, "paged_decode: head_dim must be 16, 32, 64, 128 or 256, got ", q.size(2));
  }
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
  if (int8_cache && q.scalar_type() == at::kFloat) {
    paged_decode_int8_dispatch_dim<float>(q, k_cache, v_cache, block_tables, context_lens, scale, window, out);
  } else if (int8_cache) {
    paged_decode_int8_dispatch_dim<BFloat16>(q, k_cache, v_cache, block_tables, context_lens, scale, window, out);
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

// ---- residual add + RMSNorm -----------------------------------------------------------------
// residual [N, H] fp32 += x (any of fp32/bf16, optional); returns weight * rms_norm(residual) in the
// weight's dtype, the normalised row rounded to that dtype before the weight multiplies it (as
// `weight * F.rms_norm(h.float()).to(weight.dtype)` does).
template <typename T>
at::Tensor add_rms_norm_impl(at::Tensor& residual, const std::optional<at::Tensor>& x, const at::Tensor& weight,
                             double eps) {
  const int64_t N = residual.size(0), H = residual.size(1);
  at::Tensor out = at::empty({N, H}, weight.options());
  float* rp = residual.data_ptr<float>();
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const bool has_x = x.has_value();
  const at::ScalarType xt = has_x ? x->scalar_type() : at::kFloat;
  at::parallel_for(0, N, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> tmp(H);
    for (int64_t n = begin; n < end; ++n) {
      float* r = rp + n * H;
      if (has_x) {
        if (xt == at::kFloat) {
          const float* xp = x->data_ptr<float>() + n * H;
          for (int64_t i = 0; i < H; ++i) r[i] += xp[i];
        } else {
          const BFloat16* xp = x->data_ptr<BFloat16>() + n * H;
          for (int64_t i = 0; i < H; ++i) r[i] += static_cast<float>(xp[i]);
        }
      }
      float sum = 0.f;
      for (int64_t i = 0; i < H; ++i) sum += r[i] * r[i];
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(H) + static_cast<float>(eps));
      for (int64_t i = 0; i < H; ++i) tmp[i] = round_to<T>(static_cast<float>(wp[i]) * round_to<T>(r[i] * inv));
      store_floats(tmp.data(), op + n * H, H);
    }
  });
  return out;
}

at::Tensor add_rms_norm(at::Tensor residual, const std::optional<at::Tensor>& x, const at::Tensor& weight,
                        double eps) {
  TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous() && residual.scalar_type() == at::kFloat,
              "add_rms_norm: the residual must be a contiguous fp32 [N, H]");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == residual.size(1), "add_rms_norm: weight must be [H]");
  if (x.has_value()) {
    TORCH_CHECK(x->sizes() == residual.sizes() && x->is_contiguous() &&
                    (x->scalar_type() == at::kFloat || x->scalar_type() == at::kBFloat16),
                "add_rms_norm: x must be a contiguous fp32/bf16 tensor shaped as the residual");
  }
  if (weight.scalar_type() == at::kFloat) return add_rms_norm_impl<float>(residual, x, weight, eps);
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16, "add_rms_norm: fp32 or bf16 weight only");
  return add_rms_norm_impl<BFloat16>(residual, x, weight, eps);
}

// ---- rotary + K/V store ---------------------------------------------------------------------
// qkv [N, (Hq + 2 Hkv) * D] (q heads, k heads, v heads): q and k rotated in place ("rotate half"),
// then k and v written at their flat slots of the caches (a negative slot is skipped). cos/sin
// [N, D] in qkv's dtype. Each product and the sum are rounded as torch's `x * cos + rot * sin` does.
// The caches hold C (T, or fp16/bf16 under fp32 T): k and v are rounded to it as they are written; an
// int8 cache (C = int8_t) takes each head's row quantized (quantize_row).
template <typename T, typename C>
void rotary_store_impl(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                       at::Tensor& v_cache, const at::Tensor& slots, int64_t hq, int64_t hkv, int64_t D) {
  const int64_t N = qkv.size(0), half = D / 2, row_stride = qkv.stride(0);
  const int64_t kv_row = hkv * D, cache_row = hkv * k_cache.size(3);
  T* xp = qkv.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  C* kc = k_cache.data_ptr<C>();
  C* vc = v_cache.data_ptr<C>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  at::parallel_for(0, N, 4, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      T* row = xp + n * row_stride;
      const T* c = cp + n * cos.stride(0);
      const T* s = sp + n * sin.stride(0);
      for (int64_t head = 0; head < hq + hkv; ++head) {
        T* x = row + head * D;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
          const float a1 = round_to<T>(x1 * static_cast<float>(c[i]));
          const float b1 = round_to<T>(-x2 * static_cast<float>(s[i]));
          const float a2 = round_to<T>(x2 * static_cast<float>(c[i + half]));
          const float b2 = round_to<T>(x1 * static_cast<float>(s[i + half]));
          x[i] = T(a1 + b1);
          x[i + half] = T(a2 + b2);
        }
      }
      if (slot[n] >= 0) {
        if constexpr (std::is_same_v<C, int8_t>) {
          for (int64_t head = 0; head < hkv; ++head) {
            quantize_row(row + (hq + head) * D, kc + slot[n] * cache_row + head * (D + kScaleBytes), D);
            quantize_row(row + (hq + hkv + head) * D, vc + slot[n] * cache_row + head * (D + kScaleBytes), D);
          }
        } else if constexpr (std::is_same_v<T, C>) {
          std::copy(row + hq * D, row + hq * D + kv_row, kc + slot[n] * kv_row);
          std::copy(row + hq * D + kv_row, row + hq * D + 2 * kv_row, vc + slot[n] * kv_row);
        } else {  // T is fp32 here (kv_pair_ok)
          store_floats(row + hq * D, kc + slot[n] * kv_row, kv_row);
          store_floats(row + hq * D + kv_row, vc + slot[n] * kv_row, kv_row);
        }
      }
    }
  });
}

void rotary_store(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache,
                  const at::Tensor& slots, int64_t num_q_heads, int64_t num_kv_heads) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
              "rotary_store: caches must be contiguous and alike");
  const int64_t D = k_cache.size(3) - (k_cache.scalar_type() == at::kChar ? kScaleBytes : 0);
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == (num_q_heads + 2 * num_kv_heads) * D &&
                  k_cache.size(2) == num_kv_heads && D % 2 == 0,
              "rotary_store: qkv must be [N, (Hq + 2 Hkv) * D] with contiguous rows");
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == D && cos.stride(1) == 1 && sin.sizes() == cos.sizes() &&
                  sin.stride(1) == 1 && cos.size(0) == qkv.size(0),
              "rotary_store: cos/sin must be [N, D]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == qkv.size(0),
              "rotary_store: slots must be int64 [N]");
  TORCH_CHECK(qkv.scalar_type() == cos.scalar_type() && sin.scalar_type() == cos.scalar_type() &&
                  k_cache.scalar_type() == v_cache.scalar_type() && kv_pair_ok(qkv.scalar_type(), k_cache.scalar_type()),
              "rotary_store: qkv and cos/sin must share a dtype, the caches hold it (fp16/bf16 under fp32, or int8)");
  const at::ScalarType cache = k_cache.scalar_type();
  if (cache == at::kChar && qkv.scalar_type() == at::kFloat) {
    return rotary_store_impl<float, int8_t>(qkv, cos, sin, k_cache, v_cache, slots, num_q_heads, num_kv_heads, D);
  }
  if (cache == at::kChar) {
    return rotary_store_impl<BFloat16, int8_t>(qkv, cos, sin, k_cache, v_cache, slots, num_q_heads, num_kv_heads, D);
  }
  if (qkv.scalar_type() == at::kFloat && cache == at::kFloat) {
    return rotary_store_impl<float, float>(qkv, cos, sin, k_cache, v_cache, slots, num_q_heads, num_kv_heads, D);
  }
  if (qkv.scalar_type() == at::kFloat && cache == at::kHalf) {
    return rotary_store_impl<float, Half>(qkv, cos, sin, k_cache, v_cache, slots, num_q_heads, num_kv_heads, D);
  }
  if (qkv.scalar_type() == at::kFloat) {
    return rotary_store_impl<float, BFloat16>(qkv, cos, sin, k_cache, v_cache, slots, num_q_heads, num_kv_heads, D);
  }
  rotary_store_impl<BFloat16, BFloat16>(qkv, cos, sin, k_cache, v_cache, slots, num_q_heads, num_kv_heads, D);
}

// ---- SiLU(gate) * up ------------------------------------------------------------------------
// gate_up [N, 2I] (gate first) -> [N, I]; silu rounded to the dtype before the product, as eager.
template <typename T>
at::Tensor silu_mul_impl(const at::Tensor& gate_up) {
  const int64_t N = gate_up.size(0), I = gate_up.size(1) / 2;
  at::Tensor out = at::empty({N, I}, gate_up.options());
  const T* gp = gate_up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  constexpr int64_t kChunk = 256;
  const int64_t chunks = (I + kChunk - 1) / kChunk;
  at::parallel_for(0, N * chunks, 16, [&](int64_t begin, int64_t end) {
    alignas(64) float g[kChunk], u[kChunk];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / chunks, lo = (task % chunks) * kChunk, m = std::min(kChunk, I - lo);
      const T* gate = gp + n * 2 * I + lo;
      const T* up = gate + I;
      for (int64_t i = 0; i < m; ++i) g[i] = static_cast<float>(gate[i]), u[i] = static_cast<float>(up[i]);
      int64_t i = 0;
      for (; i + W <= m; i += W) {
        const Vec x = Vec::loadu(g + i);
        (x / (Vec(1.f) + x.neg().exp())).store(g + i);
      }
      for (; i < m; ++i) g[i] = g[i] / (1.f + std::exp(-g[i]));
      for (i = 0; i < m; ++i) g[i] = round_to<T>(g[i]) * u[i];
      store_floats(g, op + n * I + lo, m);
    }
  });
  return out;
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up must be a contiguous [N, 2I]");
  if (gate_up.scalar_type() == at::kFloat) return silu_mul_impl<float>(gate_up);
  TORCH_CHECK(gate_up.scalar_type() == at::kBFloat16, "silu_mul: fp32 or bf16 only");
  return silu_mul_impl<BFloat16>(gate_up);
}

}  // namespace

// How many threads an at::parallel_for over `n` items runs on here: the library's ops split their
// work this way, and a build without OpenMP would run each on one thread (tests check it).
int64_t parallel_threads(int64_t n) {
  std::mutex lock;
  std::set<std::thread::id> seen;
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) {
    volatile double sink = 0;  // a little work, so one thread does not take every item before the others start
    for (int i = 0; i < 200000; ++i) sink = sink + i;
    std::lock_guard<std::mutex> hold(lock);
    seen.insert(std::this_thread::get_id());
  });
  return static_cast<int64_t>(seen.size());
}

TORCH_LIBRARY(tollway_cpu, m) {
  m.def("parallel_threads(int n) -> int", &parallel_threads);
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, "
        "float scale, int window) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) residual, Tensor? x, Tensor weight, float eps) -> Tensor");
  m.def("rotary_store(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) k_cache, Tensor(c!) v_cache, "
        "Tensor slots, int num_q_heads, int num_kv_heads) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(tollway_cpu, CPU, m) {
  m.impl("paged_decode", &paged_decode);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary_store", &rotary_store);
  m.impl("silu_mul", &silu_mul);
}
