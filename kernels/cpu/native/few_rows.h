// few_rows_linear's bf16 kernel (few_rows_bf16.cpp), called by the op in few_rows.cpp where x and the weight
// are bf16: y [M, N] bf16 = x [M, K] @ weight [N, K]^T, x and weight contiguous, M <= kFewRowsBf16MaxRows, K even.
#pragma once

#include "common.h"

namespace tollway_native {

constexpr int64_t kFewRowsBf16MaxRows = 64;  // 4 vectors of 16 rows of x: the kernel's widest accumulator tile

#if defined(CPU_CAPABILITY_AVX512)
void few_rows_bf16(const at::Tensor& x, const at::Tensor& weight, at::Tensor& y);  // y [M, N] bf16, contiguous
#endif

}  // namespace tollway_native
