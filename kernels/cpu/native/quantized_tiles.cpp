// torch.ops.tollway_cpu.int4_tile_matmul / int8_tile_matmul: y [M, N] bf16 = x [M, K] bf16 @ W.T for the
// native weight tiles (quantized_matmul.cpp's layout), on AVX512-BF16, for the rows between the row kernels'
// crossover and 1024 (kernels/quantized/cpu.py, TILE_GEMM_MAX_ROWS).
//
// Above the crossover the caller used to dequantize the whole weight into a fresh bf16 tensor and run an
// unpacked GEMM on it: 30 layers' projections at 48 rows took 50.7 ms on a 2-core EPYC, 8.6 of them writing the
// dequantized weights and the unpacked GEMM ~20% slower than oneDNN's packed one on the unquantized model. Here
// each group of 4 tiles (32 output rows of W) is dequantized once into a thread's buffer (bf16, rounded as
// int*_dequantize rounds them: the same weights as that path), transposed into pairs of K (each 32 bits holds
// w[c][2p] and w[c][2p + 1]), and every row of x is multiplied by it on vdpbf16ps: a broadcast pair of x times
// 16 columns' pairs, 32 exact products summed into 16 fp32 columns per instruction, kRows rows of x per pass.
// No horizontal sums (a first version summed 8 dot products per row and tile across lanes: 37.8 ms for 30 layers'
// projections at 48 rows where this takes 34.1, level with oneDNN's packed bf16 GEMM of the unquantized model).
// The outputs differ from the dequantized GEMM's only in fp32 summation order.
#include "common.h"
#include "quantized_q8.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

namespace {

using namespace tollway_native;
constexpr int64_t kTile = tollway_q8::kTile;  // output rows per weight tile
constexpr int64_t kBytes = 16;                // bytes of one row's block: 32 int4 or 16 int8 codes

#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t kCols = 32;  // output columns per group: 4 weight tiles, two vectors of 16 fp32 sums
constexpr int64_t kRows = 6;   // rows of x per pass: 6 x 2 accumulators, the group's two weight vectors

// Tile t's 8 rows dequantized into buf [8][K] bf16: int4 w = q * scale + min per group, int8 w = q * scale.
template <int64_t Bits>
void dequantize_tile(const uint8_t* tile, const float* scales, const float* mins, int64_t t, int64_t K,
                     int64_t group, BFloat16* buf) {
  constexpr int64_t per_block = Bits == 4 ? 32 : 16;  // codes in one row's 16 bytes
  const int64_t blocks = K / per_block, G = Bits == 4 ? K / group : 1;
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t c = 0; c < kTile; ++c) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + (b * kTile + c) * kBytes));
      BFloat16* dst = buf + c * K + b * per_block;
      if constexpr (Bits == 4) {
        const int64_t at = (t * G + b * per_block / group) * kTile + c;
        const __m512i codes = _mm512_cvtepu8_epi32(raw);
        Vec q[2] = {Vec(_mm512_cvtepi32_ps(_mm512_and_si512(codes, _mm512_set1_epi32(15)))),
                    Vec(_mm512_cvtepi32_ps(_mm512_srli_epi32(codes, 4)))};
        for (auto& v : q) v = v * Vec(scales[at]) + Vec(mins[at]);  // as int4_dequantize
        at::vec::convert_from_float<BFloat16>(q[0], q[1]).store(dst);
      } else {
        const Vec q = Vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw))) * Vec(scales[t * kTile + c]);
        at::vec::convert_from_float<BFloat16>(q, q).store(dst, 16);
      }
    }
  }
}

// The group's dequantized rows (buf [kCols][K] bf16) as pairs [K / 2][kCols] of 32 bits: pairs[p][c] holds
// w[c][2p] and w[c][2p + 1], what vdpbf16ps multiplies by a broadcast pair of x.
TOLLWAY_BF16_DOT void to_pairs(const BFloat16* buf, int64_t K, uint32_t* pairs) {
  const uint32_t* rows = reinterpret_cast<const uint32_t*>(buf);  // [kCols][K / 2]
  for (int64_t p0 = 0; p0 < K / 2; p0 += 16) {
    for (int64_t c0 = 0; c0 < kCols; c0 += 16) {
      __m512i r[16];
      for (int64_t i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(rows + (c0 + i) * (K / 2) + p0);
      transpose16(r);
      for (int64_t j = 0; j < 16; ++j) _mm512_storeu_si512(pairs + (p0 + j) * kCols + c0, r[j]);
    }
  }
}

// y[m0 .. m0 + R) columns [n0, n0 + cols) = x rows @ the group's weights (pairs): R x 2 accumulators of 16
// columns, x's pairs broadcast; no horizontal sums.
template <int64_t R>
TOLLWAY_BF16_DOT void pair_rows(const BFloat16* x, int64_t m0, int64_t K, const uint32_t* pairs, BFloat16* y,
                                int64_t N, int64_t n0, int64_t cols) {
  __m512 acc[R][2];
  for (int64_t r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const int32_t* x32 = reinterpret_cast<const int32_t*>(x);
  for (int64_t p = 0; p < K / 2; ++p) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(pairs + p * kCols);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(pairs + p * kCols + 16);
#pragma GCC unroll 8
    for (int64_t r = 0; r < R; ++r) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(x32[(m0 + r) * (K / 2) + p]);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t h = 0; h < 2 && 16 * h < cols; ++h) {
      const __mmask16 keep = static_cast<__mmask16>((1u << std::min<int64_t>(16, cols - 16 * h)) - 1);
      _mm256_mask_storeu_epi16(y + (m0 + r) * N + n0 + 16 * h, keep, (__m256i)_mm512_cvtneps_pbh(acc[r][h]));
    }
  }
}

template <int64_t Bits>
void tile_matmul(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor* mins,
                 int64_t N, int64_t group, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), tiles = qweight.size(0), tile_bytes = qweight.size(1);
  constexpr int64_t per_group = kCols / kTile;  // weight tiles per group of columns
  const BFloat16* xp = x.data_ptr<BFloat16>();
  const uint8_t* wp = static_cast<const uint8_t*>(qweight.data_ptr());
  const float* sp = scales.data_ptr<float>();
  const float* mp = mins ? mins->data_ptr<float>() : nullptr;
  BFloat16* yp = out.data_ptr<BFloat16>();
  at::parallel_for(0, (tiles + per_group - 1) / per_group, 1, [&](int64_t begin, int64_t end) {
    std::vector<BFloat16> buf(kCols * K);        // this thread's group of dequantized rows
    std::vector<uint32_t> pairs(kCols * K / 2);  // the same as pairs of K
    for (int64_t g = begin; g < end; ++g) {
      for (int64_t i = 0; i < per_group; ++i) {
        const int64_t t = g * per_group + i;
        if (t < tiles) {
          dequantize_tile<Bits>(wp + t * tile_bytes, sp, mp, t, K, group, buf.data() + i * kTile * K);
        } else {  // past the last tile: zero rows, whose columns are not stored
          std::fill(buf.begin() + i * kTile * K, buf.begin() + (i + 1) * kTile * K, BFloat16(0.f));
        }
      }
      to_pairs(buf.data(), K, pairs.data());
      const int64_t n0 = g * kCols, cols = std::min(kCols, N - n0);
      auto pass = [&]<int64_t R>(int64_t m0) { pair_rows<R>(xp, m0, K, pairs.data(), yp, N, n0, cols); };
      tollway_q8::row_passes<kRows>(M, pass);
    }
  });
}
#endif

bool tiles_available() {
#if defined(CPU_CAPABILITY_AVX512)
  return bf16_dot_available();
#else
  return false;
#endif
}

void check(const at::Tensor& x, const at::Tensor& qweight, int64_t N, int64_t K, const char* op) {
  TORCH_CHECK(tiles_available(), op, ": needs a CPU with AVX512-BF16 (tile_matmul_available() says so)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.size(1) == K && K % 32 == 0,
              op, ": x must be a contiguous bf16 [M, K] with K a multiple of 32");
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() && qweight.size(0) == (N + kTile - 1) / kTile, op,
              ": qweight must be the native tiles of ", N, " rows");
}

at::Tensor int4_tile_matmul(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                            const at::Tensor& mins, int64_t N, int64_t group) {
  const int64_t K = qweight.size(1) / 4;
  check(x, qweight, N, K, "int4_tile_matmul");
  TORCH_CHECK(qweight.scalar_type() == at::kByte && group % 32 == 0 && K % group == 0 &&
                  scales.scalar_type() == at::kFloat && mins.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  mins.is_contiguous() && scales.numel() == qweight.size(0) * (K / group) * kTile &&
                  mins.numel() == scales.numel(),
              "int4_tile_matmul: uint8 tiles, groups of a multiple of 32, fp32 scale and min tiles");
  at::Tensor out = at::empty({x.size(0), N}, x.options());
#if defined(CPU_CAPABILITY_AVX512)
  tile_matmul<4>(x, qweight, scales, &mins, N, group, out);
#endif
  return out;
}

at::Tensor int8_tile_matmul(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, int64_t N) {
  const int64_t K = qweight.size(1) / kTile;
  check(x, qweight, N, K, "int8_tile_matmul");
  TORCH_CHECK(qweight.scalar_type() == at::kChar && scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.numel() == qweight.size(0) * kTile,
              "int8_tile_matmul: int8 tiles and fp32 scale tiles");
  at::Tensor out = at::empty({x.size(0), N}, x.options());
#if defined(CPU_CAPABILITY_AVX512)
  tile_matmul<8>(x, qweight, scales, nullptr, N, K, out);
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tollway_cpu, m) {
  m.def("int4_tile_matmul(Tensor x, Tensor qweight, Tensor scales, Tensor mins, int n, int group) -> Tensor");
  m.def("int8_tile_matmul(Tensor x, Tensor qweight, Tensor scales, int n) -> Tensor");
  m.def("tile_matmul_available() -> bool", [] { return tiles_available(); });
}

TORCH_LIBRARY_IMPL(tollway_cpu, CPU, m) {
  m.impl("int4_tile_matmul", &int4_tile_matmul);
  m.impl("int8_tile_matmul", &int8_tile_matmul);
}
