// The int8-activation quantized matmuls (issue 22), registered as torch.ops.tollway_cpu.int4_matmul_q8 /
// int8_matmul_q8, and tollway_cpu::q8_kernel: the same arguments as quantized_matmul.cpp's int4_matmul /
// int8_matmul, the same weight tiles, and x rounded to int8 per row and block of 32 columns (quantized_q8.h);
// int4's scales and mins may also be fp16 tiles on the avx2 implementation.
// `implementation` picks the kernel: "auto" (AVX512-VNNI where the CPU has it, else AVX2), "vnni" or "avx2"
// (tests run both where both exist). (Not named `kernel`: inductor's extern call takes that keyword itself.) Every build of the library (AVX2 or AVX512 flags) has the AVX2 one.
#include "quantized_q8.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>

namespace {

using tollway_q8::kTile;
using tollway_q8::kXBlock;

std::string q8_kernel() { return tollway_q8::vnni_available() ? "vnni" : "avx2"; }

at::Tensor matmul_q8_op(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const at::Tensor* mins, int64_t N, int64_t group, bool int4,
                        const std::string& implementation, const char* op) {
  const std::string chosen = implementation == "auto" ? q8_kernel() : implementation;
  TORCH_CHECK(chosen == "avx2" || chosen == "vnni", op, ": implementation must be auto, vnni or avx2, got ",
              implementation);
  TORCH_CHECK(chosen != "vnni" || tollway_q8::vnni_available(), op, ": this CPU (or build) has no AVX512-VNNI");
  const int64_t K = int4 ? qweight.size(1) / 4 : qweight.size(1) / kTile;
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() && qweight.size(0) == (N + kTile - 1) / kTile, op,
              ": qweight must be contiguous tiles for ", N, " rows");
  TORCH_CHECK(qweight.scalar_type() == (int4 ? at::kByte : at::kChar), op, ": qweight has the wrong dtype");
  TORCH_CHECK(K % kXBlock == 0, op, ": K must be a multiple of 32, got ", K);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, op, ": x must be [M, ", K, "], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op, ": x must be fp32 or bf16");
  const int64_t per_tile = int4 ? (K / group) * kTile : kTile;
  TORCH_CHECK(!int4 || (group % kXBlock == 0 && K % group == 0), op, ": group must be a multiple of 32 dividing K");
  const bool half_scales = int4 && chosen == "avx2" && scales.scalar_type() == at::kHalf;  // AVX2 int4 only
  TORCH_CHECK((scales.scalar_type() == at::kFloat || half_scales) && scales.is_contiguous() &&
                  scales.numel() == qweight.size(0) * per_tile,
              op, ": scales must be contiguous fp32 tiles (or fp16 for int4 on the avx2 implementation)");
  TORCH_CHECK(!int4 || (mins->scalar_type() == scales.scalar_type() && mins->is_contiguous() &&
                        mins->numel() == scales.numel()),
              op, ": mins must be contiguous tiles as the scales, of their dtype");
  at::Tensor out = at::empty({x.size(0), N}, x.options());
  const at::Tensor xc = x.contiguous();
  if (chosen == "vnni") {
    tollway_q8::vnni_matmul(xc, qweight, scales, mins, N, group, int4, out);
  } else {
    tollway_q8::avx2_matmul(xc, qweight, scales, mins, N, group, int4, out);
  }
  return out;
}

at::Tensor int4_matmul_q8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                          const at::Tensor& mins, int64_t N, int64_t group, c10::string_view implementation) {
  return matmul_q8_op(x, qweight, scales, &mins, N, group, true, std::string(implementation), "int4_matmul_q8");
}

at::Tensor int8_matmul_q8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, int64_t N,
                          c10::string_view implementation) {
  return matmul_q8_op(x, qweight, scales, nullptr, N, qweight.size(1) / kTile, false, std::string(implementation),
                      "int8_matmul_q8");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tollway_cpu, m) {
  m.def("int4_matmul_q8(Tensor x, Tensor qweight, Tensor scales, Tensor mins, int n, int group, str implementation='auto') "
        "-> Tensor");
  m.def("int8_matmul_q8(Tensor x, Tensor qweight, Tensor scales, int n, str implementation='auto') -> Tensor");
  m.def("q8_kernel() -> str", &q8_kernel);  // no tensor arguments: one kernel for every key
}

TORCH_LIBRARY_IMPL(tollway_cpu, CPU, m) {
  m.impl("int4_matmul_q8", &int4_matmul_q8);
  m.impl("int8_matmul_q8", &int8_matmul_q8);
}
