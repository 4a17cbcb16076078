// Weight-only quantized matmuls with int8 activations on AVX512-VNNI (issue 22): tollway_q8::vnni_matmul, which
// torch.ops.tollway_cpu.int4_matmul_q8 / int8_matmul_q8 run where the CPU has VNNI (quantized_q8.cpp).
//
// The weights are quantized_matmul.cpp's tiles, as they are. x [M, K] (fp32 or bf16; y in x's dtype)
// is quantized per row and block of 32 columns to int8, llama.cpp's Q8_0 way: dx = max |x_blk| / 127,
// xq = round(x / dx). Each block's dot products then run as integer multiply-adds (vpdpbusd: 64 u8 x
// s8 products summed in fours into 16 int32 lanes per instruction), and the float work is one
// conversion and one multiply-add per 16 lanes per block, against quantized_matmul.cpp's conversion,
// scale multiply and multiply-add per 16 weights. The error this adds is x's rounding to 7 bits plus
// sign per block, the order of bf16's own (8 bits per value); so the caller takes this path in decode
// steps only (kernels/quantized/cpu.py `decode_step`): prefill and prompt logprobs keep the exact kernels.
//
// Lane layout. A weight tile block holds 8 rows x 16 bytes; rows 4h .. 4h + 3 (a "quad") are 64
// adjacent bytes, one 512-bit load whose 128-bit lane j is row 4h + j. For int4 that load's low
// nibbles are the rows' codes k0..15 of the x block and its high nibbles k16..31; for int8 the
// loads of tile blocks 2b and 2b + 1 are k0..15 and k16..31. x's block (32 int8, k order) is
// broadcast to every lane as k0..15 and as k16..31, so two vpdpbusd give each row's 32 products
// summed into its lane's 4 int32s: two integer multiply-adds per 128 weights.
//   int4: y[m, n] = sum_b scale[n, g(b)] dx[m, b] isum[m, n, b] + sum_g min[n, g] xsum[m, g]
//         (codes 0..15 are the unsigned operand; xsum exact, from x itself).
//   int8: codes w are signed: w ^ 0x80 = w + 128 is the unsigned operand, so
//         y[m, n] = scale[n] (sum_b dx[m, b] isum'[m, n, b] - 128 sum_b dx[m, b] sum_{k in b} xq[m, k]).
#include "quantized_q8.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

using tollway_q8::kTile;
using tollway_q8::kXBlock;
using tollway_q8::row_passes;
constexpr int64_t kMaxRows = 8;  // rows of x per pass over a tile: 8 x 2 accumulators (of 32 registers)

#if defined(CPU_CAPABILITY_AVX512)
#define TOLLWAY_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))

// x rows quantized: xq [M, K] int8 (blocks of 32 in k order), dx [M, K / 32], and per row
// either xsum [M, G] (the exact sums of x per weight group: int4) or corr [M] (int8's offset term).
// They live in buffers of the calling thread, kept between calls and grown as needed: a decode step
// makes ~120 of these calls, and allocating four tensors in each cost ~2.5% of a single int4 stream's speed
// (ops/bench/single_stream.py: 195-200 tok/s with them, 200-206 without, on a 2-core AVX512-VNNI host). Valid
// until the thread's next quantize_rows; the matmul's worker threads only read them.
struct QuantizedRows {
  int64_t M, K;
  const int8_t* xq;
  const float* dx;
  const float* xsum;
  const float* corr;
};

struct RowBuffers {
  std::vector<int8_t> xq;
  std::vector<float> dx, xsum, corr;
};

TOLLWAY_VNNI inline __m512 load_x16(const float* x) { return _mm512_loadu_ps(x); }
TOLLWAY_VNNI inline __m512 load_x16(const c10::BFloat16* x) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

template <typename T>
TOLLWAY_VNNI QuantizedRows quantize_rows(const at::Tensor& x, int64_t group, bool int4) {
  const int64_t M = x.size(0), K = x.size(1), nb = K / kXBlock;
  thread_local RowBuffers buffers;
  buffers.xq.resize(M * K);
  buffers.dx.resize(M * nb);
  buffers.xsum.assign(int4 ? M * (K / group) : 0, 0.f);
  buffers.corr.assign(M, 0.f);
  int8_t* xq = buffers.xq.data();
  float* dx = buffers.dx.data();
  float* xsum = buffers.xsum.data();
  float* corr = buffers.corr.data();
  const T* xp = x.data_ptr<T>();
  const int64_t per_group = int4 ? group / kXBlock : 1;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const __m512 lo = load_x16(xp + m * K + b * kXBlock), hi = load_x16(xp + m * K + b * kXBlock + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(inv)));  // round to nearest even
      const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(inv)));
      const __m128i blo = _mm512_cvtsepi32_epi8(qlo), bhi = _mm512_cvtsepi32_epi8(qhi);
      int8_t* dst = xq + m * K + b * kXBlock;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), blo);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), bhi);
      dx[m * nb + b] = d;
      if (int4) {
        xsum[m * (K / group) + b / per_group] += _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
      } else {
        corr[m] += 128.f * d * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi)));
      }
    }
  }
  return QuantizedRows{M, K, xq, dx, xsum, corr};
}

TOLLWAY_VNNI inline float sum4(__m128 v) {
  v = _mm_add_ps(v, _mm_movehl_ps(v, v));
  return _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
}

// A quad's accumulator -> its 4 rows' totals (row 4h + j: the 4 lanes of 128-bit lane j).
TOLLWAY_VNNI inline void quad_sums(__m512 acc, float* out) {
  out[0] = sum4(_mm512_castps512_ps128(acc));
  out[1] = sum4(_mm512_extractf32x4_ps(acc, 1));
  out[2] = sum4(_mm512_extractf32x4_ps(acc, 2));
  out[3] = sum4(_mm512_extractf32x4_ps(acc, 3));
}

// R rows of x against one tile: sums[r][c] = sum_b (scale[c, g(b)]) dx[r, b] isum[r, c, b].
template <int64_t R, bool kInt4>
TOLLWAY_VNNI inline void tile_sums(const int8_t* xq, int64_t K, const float* dx, int64_t nb, int64_t per_group,
                                   const uint8_t* w, const float* scale, float sums[R][kTile]) {
  __m512 acc[R][2];
  for (int64_t r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const __m512i quad_index[2] = {_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
                                 _mm512_set_epi32(7, 7, 7, 7, 6, 6, 6, 6, 5, 5, 5, 5, 4, 4, 4, 4)};
  const __m512i nibble = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = 0; b < nb; ++b) {
    __m512i lo[2], hi[2];  // per quad: the products' operands for x's k0..15 and k16..31
    __m512 sv[2];          // int4: per quad, each row's group scale in its lanes
    if constexpr (kInt4) {
      const uint8_t* block = w + b * kTile * 16;
      const __m512 scales8 = _mm512_castps256_ps512(_mm256_loadu_ps(scale + (b / per_group) * kTile));
      for (int64_t h = 0; h < 2; ++h) {
        const __m512i raw = _mm512_loadu_si512(block + h * 64);
        lo[h] = _mm512_and_si512(raw, nibble);
        hi[h] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
        sv[h] = _mm512_permutexvar_ps(quad_index[h], scales8);
      }
    } else {  // codes w + 128 (w ^ 0x80): the unsigned operand
      const uint8_t* first = w + 2 * b * kTile * 16;
      for (int64_t h = 0; h < 2; ++h) {
        lo[h] = _mm512_xor_si512(_mm512_loadu_si512(first + h * 64), flip);
        hi[h] = _mm512_xor_si512(_mm512_loadu_si512(first + kTile * 16 + h * 64), flip);
      }
    }
#pragma GCC unroll 8
    for (int64_t r = 0; r < R; ++r) {
      const int8_t* xb = xq + r * K + b * kXBlock;
      const __m512i xlo = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xb)));
      const __m512i xhi = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xb + 16)));
      const __m512 d = _mm512_set1_ps(dx[r * nb + b]);
      for (int64_t h = 0; h < 2; ++h) {
        const __m512i isum = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[h], xlo), hi[h], xhi);
        acc[r][h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), kInt4 ? _mm512_mul_ps(sv[h], d) : d, acc[r][h]);
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    quad_sums(acc[r][0], sums[r]);
    quad_sums(acc[r][1], sums[r] + 4);
  }
}

template <typename T, bool kInt4>
TOLLWAY_VNNI void matmul_q8(const QuantizedRows& q, const at::Tensor& qweight, const at::Tensor& scales,
                            const at::Tensor* mins, int64_t N, int64_t group, at::Tensor& out) {
  const int64_t M = q.M, K = q.K, nb = K / kXBlock, G = kInt4 ? K / group : 1;
  const int64_t per_group = kInt4 ? group / kXBlock : 1, tile_bytes = kInt4 ? K * kTile / 2 : K * kTile;
  const int8_t* xq = q.xq;
  const float* dx = q.dx;
  const float* xsum = q.xsum;
  const float* corr = q.corr;
  const uint8_t* w = static_cast<const uint8_t*>(qweight.data_ptr());
  const float* s = scales.data_ptr<float>();
  const float* mn = kInt4 ? mins->data_ptr<float>() : nullptr;
  T* y = out.data_ptr<T>();
  at::parallel_for(0, qweight.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kTile, valid = std::min(kTile, N - n0);
      const float* ts = s + t * G * kTile;
      auto pass = [&]<int64_t R>(int64_t m0) {
        float sums[R][kTile];
        tile_sums<R, kInt4>(xq + m0 * K, K, dx + m0 * nb, nb, per_group, w + t * tile_bytes, ts, sums);
        for (int64_t r = 0; r < R; ++r) {
          alignas(32) float offsets[kTile] = {};  // int4: the tile's 8 rows' sum_g min[n, g] * xsum[r, g]
          if constexpr (kInt4) {
            __m256 mt = _mm256_setzero_ps();
            for (int64_t g = 0; g < G; ++g) {
              mt = _mm256_fmadd_ps(_mm256_loadu_ps(mn + (t * G + g) * kTile), _mm256_set1_ps(xsum[(m0 + r) * G + g]), mt);
            }
            _mm256_store_ps(offsets, mt);
          }
          for (int64_t c = 0; c < valid; ++c) {
            const float value = kInt4 ? sums[r][c] + offsets[c] : (sums[r][c] - corr[m0 + r]) * ts[c];
            y[(m0 + r) * N + n0 + c] = static_cast<T>(value);
          }
        }
      };
      row_passes<kMaxRows>(M, pass);
    }
  });
}
#endif

}  // namespace

namespace tollway_q8 {

bool vnni_available() {
#if defined(CPU_CAPABILITY_AVX512)
  return __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

void vnni_matmul(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor* mins,
                 int64_t N, int64_t group, bool int4, at::Tensor& out) {
#if defined(CPU_CAPABILITY_AVX512)
  if (x.scalar_type() == at::kFloat) {
    const QuantizedRows q = quantize_rows<float>(x, group, int4);
    int4 ? matmul_q8<float, true>(q, qweight, scales, mins, N, group, out)
         : matmul_q8<float, false>(q, qweight, scales, mins, N, group, out);
  } else {
    const QuantizedRows q = quantize_rows<c10::BFloat16>(x, group, int4);
    int4 ? matmul_q8<c10::BFloat16, true>(q, qweight, scales, mins, N, group, out)
         : matmul_q8<c10::BFloat16, false>(q, qweight, scales, mins, N, group, out);
  }
#else
  TORCH_CHECK(false, "the VNNI kernels are built with AVX512 only");
#endif
}

}  // namespace tollway_q8
