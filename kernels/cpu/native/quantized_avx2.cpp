// Weight-only quantized matmuls with int8 activations on AVX2 (issue 22): tollway_q8::avx2_matmul, which
// torch.ops.tollway_cpu.int4_matmul_q8 / int8_matmul_q8 run where the CPU has no AVX512-VNNI (quantized_q8.cpp).
//
// x is rounded to int8 per row and block of 32 columns exactly as quantized_vnni.cpp rounds it (same xq, same
// dx); the products are integer multiply-adds as llama.cpp does them without VNNI: vpmaddubsw multiplies 32
// u8 x s8 pairs and sums them in twos into int16, vpmaddwd by ones sums those in twos into int32. About 11
// instructions per 64 weights and row of x, against quantized_matmul.cpp's ~40 float ones (convert each code,
// scale, multiply-add).
//
// Lane layout. A weight tile block is 8 rows x 16 bytes (quantized_matmul.cpp); rows 2h and 2h + 1 (a "pair")
// are 32 adjacent bytes, one 256-bit load whose 128-bit lane j is row 2h + j. x's 32 int8 of the block are
// broadcast to both lanes as k0..15 and k16..31.
//   int4: the load's low nibbles are the rows' codes k0..15, its high nibbles k16..31 (codes 0..15 are the
//         unsigned operand): two vpmaddubsw (each int16 at most 2 x 15 x 127), summed in int16, one vpmaddwd.
//         y[m, n] = sum_b scale[n, g(b)] dx[m, b] isum[m, n, b] + sum_g min[n, g] xsum[m, g].
//         The scales and mins may be fp16 tiles (as GGUF's Q4_1 stores them): a quarter of the bytes an int4
//         decode step reads, and this kernel is bound by reading at one row of x.
//   int8: tile blocks 2b and 2b + 1 are k0..15 and k16..31; codes are signed, so the unsigned operand is |w|
//         and x takes w's sign (vpsignb: x * sign(w), 0 where w = 0), so each product is w * x exactly and an
//         int16 pair sum at most 2 x 128 x 127; the two halves are summed in int32.
//         y[m, n] = scale[n] sum_b dx[m, b] isum[m, n, b].
#include "quantized_q8.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <vector>

namespace {

using tollway_q8::kTile;
using tollway_q8::kXBlock;
using tollway_q8::row_passes;
constexpr int64_t kMaxRows = 4;  // rows of x per pass over a tile: 4 x 4 accumulators (spilling some of 16 registers)
constexpr int64_t kPairs = kTile / 2;

inline __m256 load_x8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load_x8(const c10::BFloat16* x) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// 8 of a tile's per-row scales or mins: fp32, or fp16 (int4's q8 copies: kernels/quantized/cpu.py `CpuPacked`).
inline __m256 load_s8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_s8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline float reduce_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float reduce_add(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// x's rows quantized (xq [M, K], dx [M, K / 32]) and, for int4, xsum [M, G]: the sums of x per weight group.
// In buffers of the calling thread kept between calls (a decode step makes ~120 calls; see quantized_vnni.cpp).
struct QuantizedRows {
  const int8_t* xq;
  const float* dx;
  const float* xsum;
};

template <typename T>
QuantizedRows quantize_rows(const at::Tensor& x, int64_t group, bool int4) {
  const int64_t M = x.size(0), K = x.size(1), nb = K / kXBlock, G = int4 ? K / group : 0;
  thread_local std::vector<int8_t> xq_buffer;
  thread_local std::vector<float> dx_buffer, xsum_buffer;
  xq_buffer.resize(M * K);
  dx_buffer.resize(M * nb);
  xsum_buffer.assign(M * G, 0.f);
  const T* xp = x.data_ptr<T>();
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleaving
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const T* src = xp + m * K + b * kXBlock;
      __m256 v[4];
      for (int i = 0; i < 4; ++i) v[i] = load_x8(src + 8 * i);
      const __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                      _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
      const float amax = reduce_max(mx);
      const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      __m256i q[4];
      for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));  // round to nearest even
      const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq_buffer.data() + m * K + b * kXBlock),
                          _mm256_permutevar8x32_epi32(bytes, order));
      dx_buffer[m * nb + b] = amax / 127.f;
      if (int4) {
        xsum_buffer[m * G + b * kXBlock / group] +=
            reduce_add(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
      }
    }
  }
  return QuantizedRows{xq_buffer.data(), dx_buffer.data(), xsum_buffer.data()};
}

// A row's 4 pair accumulators -> its 8 tile rows' totals, in order (acc[h]: lanes 0-3 row 2h, 4-7 row 2h + 1).
inline __m256 row_totals(const __m256 acc[kPairs]) {
  const __m256 t0 = _mm256_hadd_ps(acc[0], acc[1]), t1 = _mm256_hadd_ps(acc[2], acc[3]);
  const __m256 u = _mm256_hadd_ps(t0, t1);  // rows 0 2 4 6 | 1 3 5 7
  return _mm256_permutevar8x32_ps(u, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// R rows of x against one tile: sums[r] = the tile's 8 rows of sum_b (scale[c, g(b)]) dx[r, b] isum[r, c, b].
template <int64_t R, bool kInt4, typename S>
inline void tile_sums(const int8_t* xq, int64_t K, const float* dx, int64_t nb, int64_t per_group,
                      const uint8_t* w, const S* scale, __m256 sums[R]) {
  __m256 acc[R][kPairs];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t h = 0; h < kPairs; ++h) acc[r][h] = _mm256_setzero_ps();
  const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    const __m256 scales8 = kInt4 ? load_s8(scale + (b / per_group) * kTile) : _mm256_setzero_ps();
    for (int64_t h = 0; h < kPairs; ++h) {
      __m256i lo, hi;  // the pair's unsigned operands for x's k0..15 and k16..31
      __m256i sign_lo, sign_hi;  // int8: the codes, whose signs x takes
      __m256 sv;       // int4: each row's group scale in its lanes
      if constexpr (kInt4) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * kTile * 16 + h * 32));
        lo = _mm256_and_si256(raw, nibble);
        hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
        sv = _mm256_permutevar8x32_ps(scales8, _mm256_setr_epi32(2 * h, 2 * h, 2 * h, 2 * h, 2 * h + 1, 2 * h + 1,
                                                                 2 * h + 1, 2 * h + 1));
      } else {
        const uint8_t* first = w + 2 * b * kTile * 16 + h * 32;
        sign_lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(first));
        sign_hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(first + kTile * 16));
        lo = _mm256_abs_epi8(sign_lo);
        hi = _mm256_abs_epi8(sign_hi);
      }
#pragma GCC unroll 4
      for (int64_t r = 0; r < R; ++r) {
        const int8_t* xb = xq + r * K + b * kXBlock;
        const __m256i xlo = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xb)));
        const __m256i xhi = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xb + 16)));
        const __m256 d = _mm256_set1_ps(dx[r * nb + b]);
        if constexpr (kInt4) {
          const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo), _mm256_maddubs_epi16(hi, xhi));
          const __m256 isum = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
          acc[r][h] = _mm256_fmadd_ps(isum, _mm256_mul_ps(sv, d), acc[r][h]);
        } else {
          const __m256i a = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, _mm256_sign_epi8(xlo, sign_lo)), ones);
          const __m256i c = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, _mm256_sign_epi8(xhi, sign_hi)), ones);
          acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(a, c)), d, acc[r][h]);
        }
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) sums[r] = row_totals(acc[r]);
}

template <typename T, bool kInt4, typename S>
void matmul(const QuantizedRows& q, int64_t M, int64_t K, const at::Tensor& qweight, const at::Tensor& scales,
            const at::Tensor* mins, int64_t N, int64_t group, at::Tensor& out) {
  const int64_t nb = K / kXBlock, G = kInt4 ? K / group : 1;
  const int64_t per_group = kInt4 ? group / kXBlock : 1, tile_bytes = kInt4 ? K * kTile / 2 : K * kTile;
  const uint8_t* w = static_cast<const uint8_t*>(qweight.data_ptr());
  const S* s = scales.data_ptr<S>();
  const S* mn = kInt4 ? mins->data_ptr<S>() : nullptr;
  T* y = out.data_ptr<T>();
  at::parallel_for(0, qweight.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kTile, valid = std::min(kTile, N - n0);
      const S* ts = s + t * G * kTile;
      auto pass = [&]<int64_t R>(int64_t m0) {
        __m256 sums[R];
        tile_sums<R, kInt4, S>(q.xq + m0 * K, K, q.dx + m0 * nb, nb, per_group, w + t * tile_bytes, ts, sums);
        for (int64_t r = 0; r < R; ++r) {
          __m256 value;
          if constexpr (kInt4) {  // + the tile's 8 rows' sum_g min[n, g] * xsum[r, g]
            value = sums[r];
            for (int64_t g = 0; g < G; ++g) {
              value = _mm256_fmadd_ps(load_s8(mn + (t * G + g) * kTile), _mm256_set1_ps(q.xsum[(m0 + r) * G + g]),
                                      value);
            }
          } else {
            value = _mm256_mul_ps(sums[r], load_s8(ts));
          }
          alignas(32) float row[kTile];
          _mm256_store_ps(row, value);
          for (int64_t c = 0; c < valid; ++c) y[(m0 + r) * N + n0 + c] = static_cast<T>(row[c]);
        }
      };
      row_passes<kMaxRows>(M, pass);
    }
  });
}

template <typename T>
void run(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor* mins, int64_t N,
         int64_t group, bool int4, at::Tensor& out) {
  const QuantizedRows q = quantize_rows<T>(x, group, int4);
  if (!int4) {
    matmul<T, false, float>(q, x.size(0), x.size(1), qweight, scales, mins, N, group, out);
  } else if (scales.scalar_type() == at::kHalf) {
    matmul<T, true, c10::Half>(q, x.size(0), x.size(1), qweight, scales, mins, N, group, out);
  } else {
    matmul<T, true, float>(q, x.size(0), x.size(1), qweight, scales, mins, N, group, out);
  }
}

}  // namespace

namespace tollway_q8 {

void avx2_matmul(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor* mins,
                 int64_t N, int64_t group, bool int4, at::Tensor& out) {
  if (x.scalar_type() == at::kFloat) {
    run<float>(x, qweight, scales, mins, N, group, int4, out);
  } else {
    run<c10::BFloat16>(x, qweight, scales, mins, N, group, int4, out);
  }
}

}  // namespace tollway_q8
