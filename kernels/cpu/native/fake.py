"""Fake (meta) implementations of the native ops, so `torch.compile` can trace a step that calls them
(workers/engine/compiled_decode.py): dynamo runs each op on fake tensors to learn its output's shape,
dtype and strides; inductor then calls the real C++ kernel as an opaque extern. Registered once, by
`kernels.cpu.native.load()`, right after the library itself is loaded (the schemas must exist).

Each fake mirrors the C++ op's allocation (contiguous outputs, the dtype it picks); the mutations the
schemas declare (`Tensor(a!)`) are handled by torch's functionalization, which inductor turns back into
in-place calls on the same buffers (the K/V caches are written in place, never copied).
"""

from __future__ import annotations

import torch


def register_fakes() -> None:
    lib = "tollway_cpu"

    @torch.library.register_fake(f"{lib}::paged_decode")
    def _paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale, window):  # type: ignore[no-untyped-def]
        return q.new_empty(q.shape)

    @torch.library.register_fake(f"{lib}::add_rms_norm")
    def _add_rms_norm(residual, x, weight, eps):  # type: ignore[no-untyped-def]
        return residual.new_empty(residual.shape, dtype=weight.dtype)

    @torch.library.register_fake(f"{lib}::rotary_store")
    def _rotary_store(qkv, cos, sin, k_cache, v_cache, slots, num_q_heads, num_kv_heads):  # type: ignore[no-untyped-def]
        return None

    @torch.library.register_fake(f"{lib}::silu_mul")
    def _silu_mul(gate_up):  # type: ignore[no-untyped-def]
        return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)

    @torch.library.register_fake(f"{lib}::int4_matmul")
    def _int4_matmul(x, qweight, scales, mins, n, group):  # type: ignore[no-untyped-def]
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake(f"{lib}::int8_matmul")
    def _int8_matmul(x, qweight, scales, n):  # type: ignore[no-untyped-def]
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake(f"{lib}::few_rows_linear")
    def _few_rows_linear(x, weight, bias):  # type: ignore[no-untyped-def]
        return x.new_empty(x.shape[0], weight.shape[0])

    @torch.library.register_fake(f"{lib}::int4_tile_matmul")
    def _int4_tile_matmul(x, qweight, scales, mins, n, group):  # type: ignore[no-untyped-def]
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake(f"{lib}::int8_tile_matmul")
    def _int8_tile_matmul(x, qweight, scales, n):  # type: ignore[no-untyped-def]
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake(f"{lib}::int4_matmul_q8")
    def _int4_matmul_q8(x, qweight, scales, mins, n, group, implementation="auto"):  # type: ignore[no-untyped-def]
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake(f"{lib}::int8_matmul_q8")
    def _int8_matmul_q8(x, qweight, scales, n, implementation="auto"):  # type: ignore[no-untyped-def]
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake(f"{lib}::refine_top_logits")
    def _refine_top_logits(logits, weight, normed, k):  # type: ignore[no-untyped-def]
        return logits.new_empty(logits.shape, dtype=torch.float32)

    @torch.library.register_fake(f"{lib}::rms_norm_pair")
    def _rms_norm_pair(hidden, weight, eps):  # type: ignore[no-untyped-def]
        return hidden.new_empty(hidden.shape, dtype=weight.dtype), hidden.new_empty(hidden.shape)

    @torch.library.register_fake(f"{lib}::row_argmax")
    def _row_argmax(logits):  # type: ignore[no-untyped-def]
        return logits.new_empty(logits.shape[0], dtype=torch.long)
