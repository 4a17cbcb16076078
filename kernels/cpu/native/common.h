// Helpers shared by the native CPU ops' sources (kernels/cpu/native/build.py compiles them into one library):
// ATen's float vector Vec (W = 8 or 16 lanes: CPU_CAPABILITY_* picks AVX2 or AVX512), loads and stores of
// fp32/bf16/fp16 rows in fp32, the rounding torch's eager ops do, and the int8 KV cache's rows.
// Header-only (inline and templates): each source gets its own copies, the library exports none of them.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace tollway_native {

using at::BFloat16;
using at::Half;
using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();

inline float reduce_add(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
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
// Functions on AVX512-BF16's vdpbf16ps carry this: the library is built for AVX512 alone, so they are compiled
// for that extension only and called where bf16_dot_available() says the CPU has it.
#define TOLLWAY_BF16_DOT __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

inline bool bf16_dot_available() {
  static const bool available = __builtin_cpu_supports("avx512bf16");
  return available;
}

// The 16 x 16 block of 32-bit values in r transposed in place (r[i] lane j -> r[j] lane i): 32-bit and 64-bit
// interleaves within 128-bit lanes, then two rounds of 128-bit lane shuffles.
TOLLWAY_BF16_DOT inline void transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int64_t q = 0; q < 4; ++q) {  // rows 4q .. 4q + 3
    t[4 * q + 0] = _mm512_unpacklo_epi32(r[4 * q], r[4 * q + 1]);
    t[4 * q + 1] = _mm512_unpackhi_epi32(r[4 * q], r[4 * q + 1]);
    t[4 * q + 2] = _mm512_unpacklo_epi32(r[4 * q + 2], r[4 * q + 3]);
    t[4 * q + 3] = _mm512_unpackhi_epi32(r[4 * q + 2], r[4 * q + 3]);
    u[4 * q + 0] = _mm512_unpacklo_epi64(t[4 * q], t[4 * q + 2]);  // column 4L + 0 of lane L, rows 4q..4q+3
    u[4 * q + 1] = _mm512_unpackhi_epi64(t[4 * q], t[4 * q + 2]);
    u[4 * q + 2] = _mm512_unpacklo_epi64(t[4 * q + 1], t[4 * q + 3]);
    u[4 * q + 3] = _mm512_unpackhi_epi64(t[4 * q + 1], t[4 * q + 3]);
  }
  for (int64_t j = 0; j < 4; ++j) {
    const __m512i va = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88), vb = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xdd);
    const __m512i wa = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88);
    const __m512i wb = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xdd);
    r[j] = _mm512_shuffle_i32x4(va, wa, 0x88);
    r[8 + j] = _mm512_shuffle_i32x4(va, wa, 0xdd);
    r[4 + j] = _mm512_shuffle_i32x4(vb, wb, 0x88);
    r[12 + j] = _mm512_shuffle_i32x4(vb, wb, 0xdd);
  }
}
#endif

// n floats from src (fp32, bf16 or fp16) into dst, any n: 2W values per vector step, the tail one at a time.
template <typename T>
inline void load_floats(const T* src, float* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::copy(src, src + n, dst);
  } else {
    int64_t i = 0;
    for (; i + 2 * W <= n; i += 2 * W) {
      auto [lo, hi] = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(src + i));
      lo.store(dst + i);
      hi.store(dst + i + W);
    }
    for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
  }
}

// W values of p widened one at a time: the vector loads' fallback where no vector extension is compiled in.
template <typename C>
inline Vec load_each(const C* p) {
  alignas(64) float f[W];
  for (int64_t i = 0; i < W; ++i) f[i] = static_cast<float>(p[i]);
  return Vec::loadu(f);
}

// ---- the int8 KV cache (kernels/kv_int8.py) ---------------------------------------------------
// A row of one token and head: D int8 codes, then one fp16 scale per group of kGroup values (2 D / kGroup
// bytes); value = code * its group's scale.
constexpr int64_t kGroup = 16;

constexpr int64_t int8_row_bytes(int64_t D) { return D + 2 * (D / kGroup); }

// The D of int8 rows row_bytes wide (the inverse of int8_row_bytes).
constexpr int64_t int8_head_dim(int64_t row_bytes) { return row_bytes * kGroup / (kGroup + 2); }

// The scale of group g (values g * kGroup ...) of an int8 row of D codes, as a float.
inline float group_scale(const int8_t* row, int64_t D, int64_t g) {
  uint16_t bits;
  std::memcpy(&bits, row + D + 2 * g, sizeof(bits));
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// W codes from p as floats.
inline Vec load_codes(const int8_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
  return Vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(CPU_CAPABILITY_AVX2)
  return Vec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else
  return load_each(p);
#endif
}

// x (D values of T) into an int8 row, a group of kGroup at a time: s = fp16(max|x| / 127), codes round(x / s)
// (to nearest even, as torch.round) from s as stored, computed in fp32 exactly as kv_int8.quantize does, so
// either path stores the same bytes.
template <typename T>
inline void quantize_row(const T* x, int8_t* dst, int64_t D) {
  for (int64_t g = 0; g < D / kGroup; ++g) {
    const T* xg = x + g * kGroup;
    float amax = 0.f;
    for (int64_t i = 0; i < kGroup; ++i) amax = std::max(amax, std::abs(static_cast<float>(xg[i])));
    const Half scale(amax / 127.f);
    const float stored = static_cast<float>(scale);
    const float inverse = stored > 0.f ? 1.f / stored : 0.f;
    for (int64_t i = 0; i < kGroup; ++i) {
      const float code = std::nearbyint(static_cast<float>(xg[i]) * inverse);
      dst[g * kGroup + i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, code)));
    }
    std::memcpy(dst + D + 2 * g, &scale, sizeof(scale));
  }
}

// W values of a row of C (fp32, or a 16-bit cache: fp16 by F16C, bf16 by a shift into the high half, or
// int8 codes) as floats.
template <typename C>
inline Vec load_vec(const C* p) {
  if constexpr (std::is_same_v<C, float>) {
    return Vec::loadu(p);
  } else if constexpr (std::is_same_v<C, int8_t>) {
    return load_codes(p);  // an int8 cache row's codes (load_row applies their group's scale)
  } else {
#if defined(CPU_CAPABILITY_AVX512)
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    if constexpr (std::is_same_v<C, Half>) return Vec(_mm512_cvtph_ps(raw));
    else return Vec(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)));
#elif defined(CPU_CAPABILITY_AVX2)
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (std::is_same_v<C, Half>) return Vec(_mm256_cvtph_ps(raw));
    else return Vec(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16)));
#else
    return load_each(p);
#endif
  }
}

// W values at offset o (a multiple of W) of a cache row of D values of C, as floats: an int8 row's codes times
// their group's scale (W divides kGroup), any other row widened.
template <typename C, int64_t D>
inline Vec load_row(const C* row, int64_t o) {
  if constexpr (std::is_same_v<C, int8_t>) {
    static_assert(kGroup % W == 0, "a vector of codes lies in one group");
    return load_codes(row + o) * Vec(group_scale(row, D, o / kGroup));
  } else {
    return load_vec(row + o);
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

#if defined(CPU_CAPABILITY_AVX512)
// x's lanes rounded to bf16 as c10's BFloat16 does (to nearest even, a NaN to 0x7FC0), each as a 32-bit
// pattern whose low half is 0: 6 integer instructions, where ATen's convert_from_float / convert_to_float
// round trip (both halves of a pair, then widening) took ~4x that in the fused small ops' inner loops.
inline __m512i bf16_bits(const __m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  const __m512i quiet = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q),
                                              _mm512_set1_epi32(0x7FC00000));
  return _mm512_and_si512(quiet, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u)));
}
#endif

// round_to on each lane of x.
template <typename T>
inline Vec round_vec(const Vec& x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
#if defined(CPU_CAPABILITY_AVX512)
    if constexpr (std::is_same_v<T, BFloat16>) return Vec(_mm512_castsi512_ps(bf16_bits(x)));
#endif
    return std::get<0>(at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(x, x)));
  }
}

// W values of x stored as T at dst (rounded to nearest even, as store_floats and c10's types do).
template <typename T>
inline void store_vec(const Vec& x, T* dst) {
  if constexpr (std::is_same_v<T, float>) {
    x.store(dst);
  } else {
#if defined(CPU_CAPABILITY_AVX512)
    if constexpr (std::is_same_v<T, BFloat16>) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_bits(x), 16)));
      return;
    }
#endif
    at::vec::convert_from_float<T>(x, x).store(dst, W);
  }
}

// The sum of squares of a row of H floats: 2W lanes of partial sums, then their reduction (one fixed order per
// row, whatever the batch). It used to be one sequential chain per row, 8 rows interleaved to hide the adds'
// latency: ~2.6 cycles a value, the op 11 us at batch 32 on 2 threads, 60 calls a step.
inline float sum_of_squares(const float* r, int64_t H) {
  Vec a(0.f), b(0.f);
  int64_t i = 0;
  for (; i + 2 * W <= H; i += 2 * W) {
    const Vec x = Vec::loadu(r + i), y = Vec::loadu(r + i + W);
    a = at::vec::fmadd(x, x, a);
    b = at::vec::fmadd(y, y, b);
  }
  for (; i + W <= H; i += W) a = at::vec::fmadd(Vec::loadu(r + i), Vec::loadu(r + i), a);
  float sum = reduce_add(a + b);
  for (; i < H; ++i) sum += r[i] * r[i];
  return sum;
}

// 1 / rms of a row of H floats with eps (an RMSNorm's scale): add_rms_norm's and rms_norm_pair's, one expression.
inline float inverse_rms(const float* r, int64_t H, double eps) {
  return 1.f / std::sqrt(sum_of_squares(r, H) / static_cast<float>(H) + static_cast<float>(eps));
}

// The (compute dtype, cache dtype) pairs the attention ops take: fp32 or bf16 caches of their own
// dtype, fp16 or bf16 caches under fp32 compute, and int8 caches (codes + a scale per 16 values) under either.
inline bool kv_pair_ok(at::ScalarType compute, at::ScalarType cache) {
  if (cache == at::kChar) return compute == at::kFloat || compute == at::kBFloat16;
  if (compute == at::kFloat) return cache == at::kFloat || cache == at::kHalf || cache == at::kBFloat16;
  return compute == at::kBFloat16 && cache == at::kBFloat16;
}

}  // namespace tollway_native
