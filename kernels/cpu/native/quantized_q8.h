// The int8-activation quantized matmuls (issue 22): what the op entry (quantized_q8.cpp) and its two kernels
// share. quantized_vnni.cpp runs the products on AVX512-VNNI (vpdpbusd), quantized_avx2.cpp on AVX2
// (vpmaddubsw + vpmaddwd, llama.cpp's way on CPUs without VNNI); both read quantized_matmul.cpp's weight
// tiles as they are and quantize x the same way (per row and block of 32 columns, llama.cpp's Q8_0:
// dx = max |x_blk| / 127, xq = round(x / dx), to nearest even), so they differ only in fp32 summation order.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace tollway_q8 {

constexpr int64_t kTile = 8;     // output rows per weight tile (quantized_matmul.cpp)
constexpr int64_t kXBlock = 32;  // x columns per activation scale

// y [M, N] (x's dtype, allocated by the caller) = x [M, K] (contiguous fp32 or bf16) @ W.T, with x rounded to
// int8 per block; mins null for int8 weights. The caller has checked every shape and dtype.
void vnni_matmul(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor* mins,
                 int64_t N, int64_t group, bool int4, at::Tensor& out);
void avx2_matmul(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor* mins,
                 int64_t N, int64_t group, bool int4, at::Tensor& out);

bool vnni_available();  // the CPU has AVX512-VNNI and the library was built with AVX512

// pass.template operator()<R>(m0) for the rest of M rows from m0, R in [1, kRest] (no call when none are left).
template <int64_t kRest, typename Pass>
inline void last_pass(int64_t rest, int64_t m0, Pass& pass) {
  if constexpr (kRest > 0) {
    if (rest == kRest) {
      pass.template operator()<kRest>(m0);
    } else {
      last_pass<kRest - 1>(rest, m0, pass);
    }
  }
}

// A kernel's passes over one weight tile: M rows of x in passes of kMaxRows rows (pass.template operator()<R>(m0)
// handles rows m0 .. m0 + R - 1, its R accumulators in registers), the last pass with what is left.
template <int64_t kMaxRows, typename Pass>
inline void row_passes(int64_t M, Pass& pass) {
  int64_t m0 = 0;
  for (; M - m0 >= kMaxRows; m0 += kMaxRows) pass.template operator()<kMaxRows>(m0);
  last_pass<kMaxRows - 1>(M - m0, m0, pass);
}

}  // namespace tollway_q8
