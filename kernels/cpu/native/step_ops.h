// The decode step's ops as C++ functions writing into outputs their caller allocated: layer_stack.cpp's
// decode_layers calls them straight, with one buffer per role reused by every layer, instead of through
// torch's dispatcher with a fresh output per call (each op in its own source registers the allocating form).
// Each checks its arguments as its op does; `out` must have the op's output shape and dtype, contiguous.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace tollway_native {

// layer_ops.cpp: residual [N, H] fp32 += x (if any); out [N, H] = weight * rms_norm(residual), weight's dtype.
void add_rms_norm_out(at::Tensor& residual, const std::optional<at::Tensor>& x, const at::Tensor& weight, double eps,
                      at::Tensor& out);
// layer_ops.cpp: residual [N, H] fp32 += x (fp32 or bf16, its shape).
void add_residual(at::Tensor& residual, const at::Tensor& x);
// layer_ops.cpp: q and k of qkv rotated in place, k and v written at their slots (the rotary_store op).
void rotary_store(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                  at::Tensor v_cache, const at::Tensor& slots, int64_t num_q_heads, int64_t num_kv_heads);
// layer_ops.cpp: out [N, I] = silu(gate) * up of gate_up [N, 2I].
void silu_mul_out(const at::Tensor& gate_up, at::Tensor& out);
// paged_decode.cpp: out [B, Hq, D] (q's dtype) = decode attention of q over the paged caches.
void paged_decode_out(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& block_tables, const at::Tensor& context_lens, double scale, int64_t window,
                      at::Tensor& out);
// few_rows.cpp: y [M, N] = x [M, K] @ weight [N, K]^T (+ bias), fp32, or bf16 on AVX512-BF16.
void few_rows_linear_out(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                         at::Tensor& y);

}  // namespace tollway_native
