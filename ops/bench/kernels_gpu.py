"""Triton paged decode attention on a GPU: achieved bandwidth and time against torch SDPA.

Batch 64, context 4,096, 32 query / 8 KV heads, head dim 128, bf16, blocks of 16 in shuffled
order. Bandwidth counts the K and V bytes the kernel must read once (the floor for decode);
peak comes from the device's memory clock and bus width (or `--peak-gbps`). SDPA runs over
contiguous K/V of the same size. Goal: >= 60% of peak and <= 1.3x SDPA's time. Then the same step on an
int8 cache (`TOLLWAY_KV_CACHE_DTYPE=int8`): its time against the bf16 cache's.
On a machine without CUDA it says so and exits 0.

    .venv/bin/python ops/bench/kernels_gpu.py [--repeats 50] [--peak-gbps 3350]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F

BATCH, CONTEXT, Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 64, 4096, 32, 8, 128, 16


def peak_bandwidth_gbps(device: torch.device) -> float | None:
    props = torch.cuda.get_device_properties(device)
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    if not clock_khz or not bus_bits:
        return None
    return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9  # double data rate


def median_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--peak-gbps", type=float, default=None, help="override the device's peak bandwidth")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("kernels_gpu: no CUDA device here; nothing measured (run it on a GPU machine).")
        return 0
    from kernels.triton.decode import decode_attention

    device = torch.device("cuda")
    dtype = torch.bfloat16
    torch.manual_seed(0)
    blocks_each = CONTEXT // BLOCK_SIZE
    num_blocks = BATCH * blocks_each
    tables = torch.randperm(num_blocks, device=device).view(BATCH, blocks_each).to(torch.int32)
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    lens = torch.full((BATCH,), CONTEXT, dtype=torch.int32, device=device)
    q = torch.randn(BATCH, Q_HEADS, HEAD_DIM, dtype=dtype, device=device)
    scale = HEAD_DIM**-0.5

    paged = decode_attention(q, k_cache, v_cache, tables, lens, scale, max_context=CONTEXT)
    contiguous_k = k_cache[tables.long()].view(BATCH, CONTEXT, KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    contiguous_v = v_cache[tables.long()].view(BATCH, CONTEXT, KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q.unsqueeze(2), contiguous_k, contiguous_v, scale=scale, enable_gqa=True)

    max_diff = (paged.float() - sdpa().squeeze(2).float()).abs().max().item()
    triton_ms = median_ms(lambda: decode_attention(q, k_cache, v_cache, tables, lens, scale, max_context=CONTEXT),
                          args.repeats)
    sdpa_ms = median_ms(sdpa, args.repeats)
    kv_bytes = 2 * k_cache.numel() * k_cache.element_size()
    achieved = kv_bytes / (triton_ms / 1e3) / 1e9
    peak = args.peak_gbps or peak_bandwidth_gbps(device)
    print(f"device: {torch.cuda.get_device_name(device)}")
    print(f"decode B={BATCH} ctx={CONTEXT} heads {Q_HEADS}/{KV_HEADS} d={HEAD_DIM} bf16 block {BLOCK_SIZE}; "
          f"max |paged - SDPA| = {max_diff:.2e}")
    print(f"triton paged decode: {triton_ms * 1e3:8.1f} µs   {achieved:7.0f} GB/s"
          + (f"   {achieved / peak:5.1%} of peak {peak:.0f} GB/s" if peak else "   (peak unknown: pass --peak-gbps)"))
    print(f"torch SDPA (contiguous): {sdpa_ms * 1e3:8.1f} µs   triton / SDPA = {triton_ms / sdpa_ms:.2f}×")
    # The same step on an int8 cache (TOLLWAY_KV_CACHE_DTYPE=int8): half the bytes, plus each row's scale.
    from kernels.kv_int8 import dequantize, quantize

    k_int8, v_int8 = quantize(k_cache), quantize(v_cache)
    int8_out = decode_attention(q, k_int8, v_int8, tables, lens, scale, max_context=CONTEXT)
    wide_k, wide_v = dequantize(k_int8, dtype), dequantize(v_int8, dtype)
    int8_diff = (int8_out.float() - decode_attention(q, wide_k, wide_v, tables, lens, scale,
                                                     max_context=CONTEXT).float()).abs().max().item()
    int8_ms = median_ms(lambda: decode_attention(q, k_int8, v_int8, tables, lens, scale, max_context=CONTEXT),
                        args.repeats)
    int8_bytes = 2 * k_int8.numel() * k_int8.element_size()
    print(f"triton paged decode, int8 cache: {int8_ms * 1e3:8.1f} µs   {int8_bytes / (int8_ms / 1e3) / 1e9:7.0f} GB/s"
          f"   int8 / bf16 cache = {int8_ms / triton_ms:.2f}×   max |int8 - its dequantized copy| = {int8_diff:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
