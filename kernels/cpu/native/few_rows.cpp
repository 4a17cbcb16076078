// fp32 matmuls of a few rows against a plain weight (issue 21): tollway_cpu::few_rows_linear(x [M, K], weight
// [N, K], bias [N]?) -> x weight^T + bias, for the decode step's projections and LM head at M <= ~64 rows.
//
// Why: MKL's sgemm (packed or not) and oneDNN's fp32 inner product read a decode step's weights at 3-5 GB/s on
// a 2-core AVX2 EPYC whose memory streams at ~30 GB/s (ops/bench/few_rows.py): at M = 32 they reach ~55
// GFLOP/s where the same GEMM at M = 1,024 reaches ~140. Here each weight row is read once, from memory, in
// its own layout (no packed copy), and multiplied by every row of x while it sits in L1.
//
// Layout of the work: a tile is kRowsW adjacent weight rows (contiguous: kRowsW x K floats) against kRowsX rows
// of x; each of the kRowsW x kRowsX outputs is a dot product along K, accumulated in one vector (W lanes) and
// summed across lanes at the end. 4 x 3 = 12 accumulators, 4 weight vectors and one of x: the 16 registers of
// AVX2. Threads split the weight's rows (at::parallel_for over tiles), so each thread streams its own part of
// the weight once and x stays in every core's cache.
//
// Rounding: fp32 products with fused multiply-adds, summed in a different order than a BLAS sgemm: results
// differ from F.linear by fp32 rounding (relative ~1e-6), never in kind.
#include "few_rows.h"
#include "step_ops.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

namespace {

using tollway_native::reduce_add;
using tollway_native::Vec;
using tollway_native::W;

constexpr int64_t kRowsW = 4;  // weight rows per tile
constexpr int64_t kRowsX = 3;  // rows of x per pass over a tile

// y[r, c] = x[r] . w[c] for NR weight rows w (row stride K) and MR rows of x (row stride K); y's row stride ldy.
template <int64_t NR, int64_t MR>
inline void tile(const float* x, const float* w, int64_t K, float* y, int64_t ldy) {
  Vec acc[MR][NR];
  for (int64_t r = 0; r < MR; ++r)
    for (int64_t c = 0; c < NR; ++c) acc[r][c] = Vec(0.f);
  const int64_t full = K - K % W;
  for (int64_t k = 0; k < full; k += W) {
    Vec wv[NR];
    for (int64_t c = 0; c < NR; ++c) wv[c] = Vec::loadu(w + c * K + k);
    for (int64_t r = 0; r < MR; ++r) {
      const Vec xv = Vec::loadu(x + r * K + k);
      for (int64_t c = 0; c < NR; ++c) acc[r][c] = at::vec::fmadd(xv, wv[c], acc[r][c]);
    }
  }
  for (int64_t r = 0; r < MR; ++r) {
    for (int64_t c = 0; c < NR; ++c) {
      float sum = reduce_add(acc[r][c]);
      for (int64_t k = full; k < K; ++k) sum += x[r * K + k] * w[c * K + k];
      y[r * ldy + c] = sum;
    }
  }
}

// NR weight rows (from w) against every row of x: kRowsX rows a pass, the last pass 1..kRowsX - 1 rows.
template <int64_t NR>
void weight_rows(const float* x, int64_t M, const float* w, int64_t K, float* y, int64_t N) {
  int64_t m = 0;
  for (; m + kRowsX <= M; m += kRowsX) tile<NR, kRowsX>(x + m * K, w, K, y + m * N, N);
  static_assert(kRowsX == 3, "the tail below covers 1 or 2 rows");
  if (M - m == 2) tile<NR, 2>(x + m * K, w, K, y + m * N, N);
  if (M - m == 1) tile<NR, 1>(x + m * K, w, K, y + m * N, N);
}

}  // namespace

namespace tollway_native {

void few_rows_linear_out(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                         at::Tensor& y) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "few_rows_linear: x [M, K] and weight [N, K] expected, got ", x.sizes(), " and ", weight.sizes());
  TORCH_CHECK(weight.is_contiguous(), "few_rows_linear: a contiguous weight expected");
  TORCH_CHECK(y.is_contiguous() && y.dim() == 2 && y.size(0) == x.size(0) && y.size(1) == weight.size(0) &&
                  y.scalar_type() == x.scalar_type(),
              "few_rows_linear: the output must be a contiguous [M, N] in x's dtype");
  const at::Tensor xc = x.contiguous();
#if defined(CPU_CAPABILITY_AVX512)
  if (x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16) {
    few_rows_bf16(xc, weight, y);
    if (bias.has_value()) y.add_(*bias);
    return;
  }
#endif
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "few_rows_linear: fp32 x and weight expected (bf16 on AVX512-BF16 CPUs)");
  const int64_t M = xc.size(0), K = xc.size(1), N = weight.size(0);
  if (M == 0 || N == 0) return;
  const float* xp = xc.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t tiles = (N + kRowsW - 1) / kRowsW;
  // ~16 tiles (64 weight rows) a task at least: enough work per thread to hide the fork.
  at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kRowsW;
      const float* w = wp + n0 * K;
      switch (std::min(kRowsW, N - n0)) {
        case 4: weight_rows<4>(xp, M, w, K, yp + n0, N); break;
        case 3: weight_rows<3>(xp, M, w, K, yp + n0, N); break;
        case 2: weight_rows<2>(xp, M, w, K, yp + n0, N); break;
        default: weight_rows<1>(xp, M, w, K, yp + n0, N); break;
      }
    }
  });
  if (bias.has_value()) y.add_(*bias);
}

}  // namespace tollway_native

namespace {

at::Tensor few_rows_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "few_rows_linear: x [M, K] and weight [N, K] expected, got ",
              x.sizes(), " and ", weight.sizes());
  at::Tensor y = at::empty({x.size(0), weight.size(0)}, x.options());
  tollway_native::few_rows_linear_out(x, weight, bias, y);
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tollway_cpu, m) {
  m.def("few_rows_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(tollway_cpu, CPU, m) {
  m.impl("few_rows_linear", &few_rows_linear);
}
