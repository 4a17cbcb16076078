// bf16 matmuls of up to 32 rows on AMX tiles (issue 21): y [M, N] bf16 = x [M, K] @ W^T, the weight prepacked
// into the tiles' pair layout once (workers/models/packed_linear.py `pack_amx_rows`).
//
// Why: a decode step's rows read the whole model's weights once and multiply each weight value into a few rows:
// the weight's stream is the cost. On a 2-core Emerald Rapids Xeon oneDNN's packed bf16 GEMM (its AMX kernel,
// `brg_matmul:avx10_1_512_amx`) read them at 5.6-7 GB/s from 1 to 32 rows, where plain AVX-512 loads streamed
// the same bytes at ~12 GB/s; this kernel reads them at about that stream's rate: a decode step's matmuls took
// half oneDNN's time (ops/bench/RESULTS.md).
//
// Layout: packed [N / 32][K / 32][2][16][32] bf16 — for each 32 output columns (two halves of 16) and each 32
// of K, the B tile of each half: row r holds K pair (2r, 2r + 1) of its 16 columns, interleaved (VNNI), so one
// 32-column group's tiles are one sequential run of K / 32 * 2 KiB. x's rows (contiguous) are the A tiles as they
// lie (rows 0-15 and 16..M-1, 64 bytes of K a row). Per 32 of K: four TDPBF16PS (two up to 16 rows) into fp32 C
// tiles (two row halves x two column halves), stored and rounded to bf16 once at the end (as oneDNN's output).
// Products are exact, sums fp32 in the tile unit's order: results differ from oneDNN's by summation order.
//
// The tile registers are per thread: each task configures them and releases them (amx.h).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#include "amx.h"

namespace {

#if defined(CPU_CAPABILITY_AVX512)
using tollway_native::amx_available;

constexpr int64_t kAheadBytes = 64 * 1024;  // the weight stream is prefetched (to L2) this far ahead

// Tiles: C 0-1 rows 0-15 (column halves 0, 1), C 2-3 rows 16..M-1; A 4 rows 0-15, A 5 rows 16..M-1; B 6-7.
// Up to 16 rows (TWO false) tiles 2, 3 and 5 stay unconfigured and unused.
TOLLWAY_AMX void configure(int64_t M) {
  const uint8_t low = static_cast<uint8_t>(std::min<int64_t>(M, 16)), high = static_cast<uint8_t>(M - low);
  tollway_native::configure_tiles({low, low, high, high, low, high, 16, 16});
}

// Column groups [g0, g1) of 32, TWO: 17 <= M <= 32, else M <= 16.
template <bool TWO>
TOLLWAY_AMX void column_groups(const at::BFloat16* x, int64_t M, int64_t K, const at::BFloat16* packed,
                               at::BFloat16* y, int64_t N, int64_t g0, int64_t g1) {
  configure(M);
  const int64_t steps = K / 32;
  alignas(64) float c[32][32];
  for (int64_t g = g0; g < g1; ++g) {
    const char* b = reinterpret_cast<const char*>(packed + g * steps * 1024);
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (TWO) {
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int64_t s = 0; s < steps; ++s) {
      const char* bs = b + s * 2048;
      for (int64_t line = 0; line < 32; ++line) _mm_prefetch(bs + kAheadBytes + 64 * line, _MM_HINT_T1);
      _tile_loadd(4, x + s * 32, K * 2);
      _tile_loadd(6, bs, 64);
      _tile_loadd(7, bs + 1024, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if constexpr (TWO) {
        _tile_loadd(5, x + 16 * K + s * 32, K * 2);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, &c[0][0], 128);
    _tile_stored(1, &c[0][16], 128);
    if constexpr (TWO) {
      _tile_stored(2, &c[16][0], 128);
      _tile_stored(3, &c[16][16], 128);
    }
    for (int64_t m = 0; m < M; ++m) {  // round to nearest even, as oneDNN's bf16 output
      const __m512bh row = _mm512_cvtne2ps_pbh(_mm512_load_ps(&c[m][16]), _mm512_load_ps(&c[m][0]));
      _mm512_storeu_si512(y + m * N + g * 32, (__m512i)row);
    }
  }
  _tile_release();
}
#else
bool amx_available() { return false; }
#endif

at::Tensor amx_rows_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(amx_available(), "amx_rows_linear: needs a CPU with AMX-BF16 (amx_rows_available() says so)");
  TORCH_CHECK(packed.dim() == 5 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.size(2) == 2 && packed.size(3) == 16 && packed.size(4) == 32,
              "amx_rows_linear: packed must be the [N / 32, K / 32, 2, 16, 32] bf16 tiles, got ", packed.sizes());
  const int64_t N = packed.size(0) * 32, K = packed.size(1) * 32;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.size(1) == K && x.size(0) <= 32,
              "amx_rows_linear: bf16 x [M <= 32, ", K, "] expected, got ", x.sizes());
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({xc.size(0), N}, xc.options());
#if defined(CPU_CAPABILITY_AVX512)
  const at::BFloat16* xp = xc.const_data_ptr<at::BFloat16>();
  const at::BFloat16* wp = packed.const_data_ptr<at::BFloat16>();
  at::BFloat16* yp = y.mutable_data_ptr<at::BFloat16>();
  const int64_t M = xc.size(0);
  if (M == 0) return y;
  at::parallel_for(0, N / 32, 1, [&](int64_t begin, int64_t end) {
    if (M > 16) {
      column_groups<true>(xp, M, K, wp, yp, N, begin, end);
    } else {
      column_groups<false>(xp, M, K, wp, yp, N, begin, end);
    }
  });
#endif
  if (bias.has_value()) y.add_(*bias);
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tollway_cpu, m) {
  m.def("amx_rows_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.def("amx_rows_available() -> bool", [] { return amx_available(); });
}

TORCH_LIBRARY_IMPL(tollway_cpu, CPU, m) {
  m.impl("amx_rows_linear", &amx_rows_linear);
}
