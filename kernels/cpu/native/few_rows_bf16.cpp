// bf16 matmuls of a few rows against a plain weight on AVX512-BF16 (issue 21): few_rows_linear (few_rows.cpp)
// runs here for bf16 x and weight, y [M, N] bf16 = x [M, K] @ weight [N, K]^T, M <= 64.
//
// Why: a bf16 decode step's 121 projections and LM head at 32 rows took 15.6 ms on oneDNN's packed GEMM on a
// 2-core Zen 5 EPYC (AVX512-BF16, no AMX), reading the step's 269 MB of weights at ~17 GB/s; this kernel took
// 12.1 ms on the same weights (ops/bench/RESULTS.md). At 32 rows each weight value is used 32 times: the
// weight's stream from memory is what the GEMM waits on. Without the software prefetch of the weight below it
// took 15.5 ms. Which row counts run here (the rest on oneDNN): workers/models/packed_linear.py, as measured.
//
// Layout of the work, 16 rows and more: x is rewritten once per call as pairs [K / 2][Mpad] of 32 bits
// (x[m][2p], x[m][2p + 1]), Mpad = M rounded up to 16 with zero rows; a tile is NW adjacent weight rows
// (contiguous in the plain layout: one sequential stream a tile, prefetched two tiles ahead) against every row
// of x. Per pair p of K, each of the tile's NW weight rows gives one broadcast 32-bit pair and vdpbf16ps
// multiplies it by 16 rows' pairs of x: MV vectors of 16 rows x NW columns = 24 (or 16) fp32 accumulators, no
// horizontal sums. The accumulators are transposed 16 x 16 (columns to rows) and stored as bf16, as oneDNN's
// bf16 output rounds. Below 16 rows, where that would compute padded rows: dot products of a weight row and a
// row of x (row_tiles below), summed across lanes at the end; the projections' weights read 6-67% faster than
// oneDNN's at 1-4 rows.
//
// Rounding: the products are exact, summed in fp32 (in K order, or per lane then across lanes below 16 rows):
// results differ from oneDNN's bf16 GEMM by fp32 summation order before the bf16 rounding of the output.
#include "few_rows.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512)
namespace tollway_native {
namespace {

constexpr int64_t kTilesAhead = 2;  // the weight stream is prefetched this many tiles ahead of the one in use

// The tile of NW weight rows at w against every row of x (xpairs, MV vectors of 16 rows, M real): y's columns
// [n0, n0 + cols), cols <= NW (the stores keep that many). Prefetches past the weight's end are harmless.
template <int64_t MV, int64_t NW>
TOLLWAY_BF16_DOT void column_tile(const uint32_t* xpairs, int64_t Mpad, int64_t M, const BFloat16* w, int64_t K,
                                  BFloat16* y, int64_t N, int64_t n0, int64_t cols) {
  static_assert(NW <= 16 && MV * NW <= 24, "NW columns of MV vectors: the accumulators and 16-column transposes");
  const int64_t K2 = K / 2;
  const uint32_t* wpairs = reinterpret_cast<const uint32_t*>(w);  // weight row c's pairs at c * K2
  __m512 acc[NW][MV];
  for (int64_t c = 0; c < NW; ++c) {
    for (int64_t v = 0; v < MV; ++v) acc[c][v] = _mm512_setzero_ps();
  }
  // The tile kTilesAhead on: its NW * K * 2 bytes spread over this tile's K2 pair steps, a line at a time.
  const char* ahead = reinterpret_cast<const char*>(w + kTilesAhead * NW * K);
  const int64_t lines = NW * K * 2 / 64;
  int64_t fetched = 0;
  for (int64_t p = 0; p < K2; ++p) {
    while (fetched * K2 < lines * (p + 1)) _mm_prefetch(ahead + 64 * fetched++, _MM_HINT_T0);
    __m512bh xv[MV];
    for (int64_t v = 0; v < MV; ++v) xv[v] = (__m512bh)_mm512_loadu_si512(xpairs + p * Mpad + 16 * v);
#pragma GCC unroll 16
    for (int64_t c = 0; c < NW; ++c) {
      const __m512bh wb = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(wpairs[c * K2 + p]));
#pragma GCC unroll 4
      for (int64_t v = 0; v < MV; ++v) acc[c][v] = _mm512_dpbf16_ps(acc[c][v], xv[v], wb);
    }
  }
  // acc[c][v] lane j is y[16 v + j][n0 + c]: transposed, row j of vector v holds its NW columns.
  const __mmask16 keep = static_cast<__mmask16>((1u << cols) - 1);
  for (int64_t v = 0; v < MV; ++v) {
    __m512i r[16];
    for (int64_t c = 0; c < 16; ++c) r[c] = c < NW ? _mm512_castps_si512(acc[c][v]) : _mm512_setzero_si512();
    transpose16(r);
    for (int64_t j = 0; j < 16 && 16 * v + j < M; ++j) {
      _mm256_mask_storeu_epi16(y + (16 * v + j) * N + n0, keep,
                               (__m256i)_mm512_cvtneps_pbh(_mm512_castsi512_ps(r[j])));
    }
  }
}

template <int64_t MV>
TOLLWAY_BF16_DOT void all_tiles(const uint32_t* xpairs, int64_t M, const BFloat16* w, int64_t K, int64_t N,
                                BFloat16* y) {
  constexpr int64_t NW = MV == 1 ? 16 : 24 / MV;
  const int64_t Mpad = 16 * MV, tiles = (N + NW - 1) / NW;
  at::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * NW, cols = std::min(NW, N - n0);
      if (cols == NW) {
        column_tile<MV, NW>(xpairs, Mpad, M, w + n0 * K, K, y, N, n0, NW);
      } else {  // the weight's last rows: one column a pass, each stored on its own
        for (int64_t c = 0; c < cols; ++c) column_tile<MV, 1>(xpairs, Mpad, M, w + (n0 + c) * K, K, y, N, n0 + c, 1);
      }
    }
  });
}

// Below 16 rows (row_tiles): a tile is NR adjacent weight rows against MR rows of x at a time, each output a dot
// product along K (32 values a vdpbf16ps, into 16 fp32 lanes summed at the end), so no padded rows are computed.
// The weight tile is read from memory by the first group of rows (prefetched kTilesAhead tiles on), from L1 after.
template <int64_t MR, int64_t NR>
TOLLWAY_BF16_DOT void row_tile(const BFloat16* x, int64_t K, const BFloat16* w, BFloat16* y, int64_t N,
                               bool fetch_ahead) {
  __m512 acc[MR][NR];
  for (int64_t r = 0; r < MR; ++r) {
    for (int64_t c = 0; c < NR; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  // Values [k, k + 32) of every row (those `keep` names: a last partial vector of K is masked).
  auto multiply = [&](int64_t k, __mmask32 keep) TOLLWAY_BF16_DOT {
    __m512bh wv[NR];
    for (int64_t c = 0; c < NR; ++c) wv[c] = (__m512bh)_mm512_maskz_loadu_epi16(keep, w + c * K + k);
#pragma GCC unroll 4
    for (int64_t r = 0; r < MR; ++r) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(keep, x + r * K + k);
#pragma GCC unroll 8
      for (int64_t c = 0; c < NR; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
    }
  };
  const char* ahead = reinterpret_cast<const char*>(w + kTilesAhead * NR * K);
  const int64_t steps = K / 32, lines = NR * K * 2 / 64;
  int64_t fetched = 0;
  for (int64_t s = 0; s < steps; ++s) {
    if (fetch_ahead) {
      while (fetched * steps < lines * (s + 1)) _mm_prefetch(ahead + 64 * fetched++, _MM_HINT_T0);
    }
    multiply(32 * s, ~__mmask32{0});
  }
  if (K % 32 != 0) multiply(32 * steps, static_cast<__mmask32>((1ull << (K % 32)) - 1));
  for (int64_t r = 0; r < MR; ++r) {
    for (int64_t c = 0; c < NR; ++c) y[r * N + c] = BFloat16(_mm512_reduce_add_ps(acc[r][c]));
  }
}

// M < 16 rows of x against the weight: NR weight rows a tile (the last tile's rows one at a time), MR rows of x
// a pass over it.
template <int64_t MR, int64_t NR>
TOLLWAY_BF16_DOT void row_tiles(const BFloat16* x, int64_t M, const BFloat16* w, int64_t K, int64_t N,
                                BFloat16* y) {
  const int64_t tiles = (N + NR - 1) / NR;
  at::parallel_for(0, tiles, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * NR;
      if (n0 + NR <= N) {
        int64_t m = 0;
        for (; m + MR <= M; m += MR) row_tile<MR, NR>(x + m * K, K, w + n0 * K, y + m * N + n0, N, m == 0);
        for (; m < M; ++m) row_tile<1, NR>(x + m * K, K, w + n0 * K, y + m * N + n0, N, m == 0);
      } else {
        for (int64_t n = n0; n < N; ++n) {
          for (int64_t m = 0; m < M; ++m) row_tile<1, 1>(x + m * K, K, w + n * K, y + m * N + n, N, false);
        }
      }
    }
  });
}

// x [M][K] bf16 as the pairs [K2][Mpad] of 32 bits the tiles read (rows M..Mpad zero; their lanes' sums are
// never stored), in a buffer the calling thread reuses, valid until its next call. 16 rows x 16 pairs a 16 x 16
// transpose. It runs serially before the parallel tiles, the other threads waiting: the scalar loop it
// replaced, into a vector zero-filled each call, took ~1.6 ms of a 40-45 ms bf16 decode step at batch 32
// on a 2-core Zen 4 EPYC (step 41.8 -> 39.9 ms, ops/bench/RESULTS.md).
TOLLWAY_BF16_DOT const uint32_t* pairs_of_rows(const BFloat16* x, int64_t M, int64_t K2, int64_t Mpad) {
  thread_local std::vector<uint32_t> buffer;
  if (static_cast<int64_t>(buffer.size()) < K2 * Mpad) buffer.resize(K2 * Mpad);
  uint32_t* out = buffer.data();
  const uint32_t* rows = reinterpret_cast<const uint32_t*>(x);  // [M][K2]
  for (int64_t m0 = 0; m0 < Mpad; m0 += 16) {
    for (int64_t p0 = 0; p0 < K2; p0 += 16) {
      const int64_t width = std::min<int64_t>(16, K2 - p0);
      const __mmask16 keep = static_cast<__mmask16>((1u << width) - 1);
      __m512i r[16];
      for (int64_t j = 0; j < 16; ++j) {
        r[j] = m0 + j < M ? _mm512_maskz_loadu_epi32(keep, rows + (m0 + j) * K2 + p0) : _mm512_setzero_si512();
      }
      transpose16(r);  // r[i]: pair p0 + i of the 16 rows
      for (int64_t i = 0; i < width; ++i) _mm512_storeu_si512(out + (p0 + i) * Mpad + m0, r[i]);
    }
  }
  return out;
}

}  // namespace

TOLLWAY_BF16_DOT void few_rows_bf16(const at::Tensor& x, const at::Tensor& weight, at::Tensor& y) {
  TORCH_CHECK(bf16_dot_available(), "few_rows_linear: bf16 needs a CPU with AVX512-BF16");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(M <= kFewRowsBf16MaxRows, "few_rows_linear: bf16 takes at most ", kFewRowsBf16MaxRows, " rows, got ", M);
  TORCH_CHECK(K % 2 == 0, "few_rows_linear: bf16 needs an even K (pairs of K), got ", K);
  if (M == 0 || N == 0) return;
  const BFloat16* xp = x.data_ptr<BFloat16>();  // [M][K], contiguous
  const BFloat16* w = weight.data_ptr<BFloat16>();
  BFloat16* yp = y.data_ptr<BFloat16>();
  if (M < 16) {  // 8 weight rows a tile for 1-3 rows of x (2 a pass), 4 with 4 rows a pass for more
    if (M <= 3) {
      row_tiles<2, 8>(xp, M, w, K, N, yp);
    } else {
      row_tiles<4, 4>(xp, M, w, K, N, yp);
    }
    return;
  }
  const int64_t MV = (M + 15) / 16, Mpad = 16 * MV, K2 = K / 2;
  const uint32_t* xpairs = pairs_of_rows(xp, M, K2, Mpad);
  switch (MV) {
    case 1: all_tiles<1>(xpairs, M, w, K, N, yp); break;
    case 2: all_tiles<2>(xpairs, M, w, K, N, yp); break;
    case 3: all_tiles<3>(xpairs, M, w, K, N, yp); break;
    default: all_tiles<4>(xpairs, M, w, K, N, yp); break;
  }
}

}  // namespace tollway_native
#endif
