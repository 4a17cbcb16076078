"""The engine's decode step against its matmuls alone (issue 21): backend `cpu` (torch ops, plain
weights) vs `native` (C++ ops reading the paged cache in place, fused small ops, prepacked weights),
in bf16 (only where the CPU computes bf16 natively) and fp32, in one run.

One engine per dtype prefills `--batch` unrelated prompts of `--context` tokens, then runs
`--steps` decode steps on the `cpu` backend, switches the same engine (same sequences, same KV) to
`native` (packing its linears) and runs `--steps` more. The fp32 model runs once per KV cache dtype
of `--kv-cache-dtypes` (`TOLLWAY_KV_CACHE_DTYPE`: model, float16, bfloat16, int8), the bf16 model once per
`--bf16-kv-cache-dtypes` (model, int8). After each step the step's matmuls alone
(every layer's four projections and the LM head on [batch, ·] inputs, through the same modules the
step used) are timed once, so each ratio compares two medians taken under the same load.

With `--compile`, the torch.compile'd step (workers/engine/compiled_decode.py, inductor) runs after
each backend's eager one, on the same engine: `cpu+compile` (the torch step, attention over the
gathered blocks of fixed-width tables) and `native+compile` (the fused native step traced whole, the
C++ ops opaque to inductor); their first step compiles the batch's bucket, whose time is printed.

The native backend's line is followed by the step's attention alone (`paged_decode` of every layer over the
engine's own cache and block tables, timed after the matmuls, as cold as the step finds its K/V) and what is
left of the step: its small ops, the logits tail and the host's Python between them (at a batch of a few rows the
matmuls alone, ~120 module calls from Python, can cost more than the step's own, and the rest reads negative).

Each run also prints a floor: the step could not cost less than its matmuls plus reading the batch's K/V
once (every layer's rows of every sequence, in the cache's dtype) at the bandwidth `torch.sum` streams a
buffer of that size with on this machine, timed in the same run. Where the floor itself is above the
issue's 1.5x, the goal is out of reach for that cache dtype on that host whatever the kernels do.

    .venv/bin/python ops/bench/decode_step.py [--batch 32 --context 380 --steps 12] [--compile]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from kernels.cpu import native
from workers.engine.compiled_decode import CompiledDecode
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.models.assets import resolve_model_folder
from workers.models.llama import DecoderLayer, LlamaForCausalLM
from workers.models.loader import LoadedModel, load_model
from workers.models.packed_linear import pack_linears
from workers.precision import cpu_has_native_bf16
from workers.wire.sampling import SamplingParams


def cpu_flags() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")
            return " ".join(f for f in line.split(":", 1)[1].split() if f in wanted)
    return "?"


@torch.inference_mode()
def time_matmuls(model: LlamaForCausalLM, batch: int) -> float:
    c = model.config
    x = torch.randn(batch, c.hidden_size, dtype=model.dtype)
    q = torch.randn(batch, c.q_size, dtype=model.dtype)
    inner = torch.randn(batch, c.intermediate_size, dtype=model.dtype)
    start = time.perf_counter()
    for layer in model.layers:
        assert isinstance(layer, DecoderLayer)
        layer.qkv_proj(x)
        layer.o_proj(q)
        layer.gate_up_proj(x)
        layer.down_proj(inner)
    model.lm_head(x)
    return time.perf_counter() - start


@torch.inference_mode()
def time_attention(engine: Engine) -> float:
    """Seconds the step's attention alone takes: `paged_decode` of every layer over the engine's own cache and
    its sequences' block tables (as the native step calls it, each sequence's newest token attending), on a
    random q. Timed after `time_matmuls`, whose weight stream leaves the K/V as cold as the step finds them."""
    model, kv = engine.runner.model, engine.runner.kv
    c = model.config
    seqs = list(engine.sequences.values())
    tables = []
    for s in seqs:
        assert s.block_table is not None  # every sequence decodes: each holds blocks
        tables.append(s.block_table.groups[0])
    block_tables = engine.runner.table_rows.gather(tables)  # the step's own rows (padding and dropped slots: 0)
    # the tokens whose K/V the cache holds: between steps a sequence's newest token has neither K/V nor, where it
    # starts a block, a block yet (the next step's schedule appends it)
    context_lens = torch.tensor([s.computed_len for s in seqs], dtype=torch.int32)
    if any(s.computed_len > len(t.block_ids) * kv.block_size for s, t in zip(seqs, tables, strict=True)):
        raise RuntimeError("a sequence's block table does not cover its computed tokens")
    q = torch.randn(len(seqs), c.num_q_heads, c.head_dim, dtype=model.dtype)
    scale = c.head_dim**-0.5
    windows = [getattr(layer, "sliding_window", None) or 0 for layer in model.layers]
    start = time.perf_counter()
    for keys, values, window in zip(kv.keys, kv.values, windows, strict=True):
        torch.ops.tollway_cpu.paged_decode(q, keys, values, block_tables, context_lens, scale, window)
    return time.perf_counter() - start


def kv_bytes_read(engine: Engine) -> int:
    """Bytes of K/V one decode step's attention reads: each sequence's rows of every layer, once."""
    kv = engine.runner.kv  # per layer [blocks, block_size, kv_heads, row]: a token's K row and V row of each head
    per_token = sum(2 * k[0, 0].numel() * k.element_size() for k in kv.keys)
    return per_token * sum(s.total_len for s in engine.sequences.values())


def time_stream(num_bytes: int, repeats: int = 7) -> float:
    """Median seconds `torch.sum` takes to read a buffer of `num_bytes` (fp32, beyond any cache), every thread."""
    buffer = torch.ones(num_bytes // 4)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(engine: Engine, batch: int, steps: int, attention: bool = False) -> tuple[float, float, float | None]:
    """Median decode step, median matmuls-alone time and (with `attention`) median attention-alone time
    (seconds), one of each per step."""
    step_times, matmul_times, attention_times = [], [], []
    for _ in range(steps):
        if engine.num_running != batch or any(s.is_prefilling for s in engine.sequences.values()):
            raise RuntimeError("every sequence must decode in each measured step")
        start = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - start)
        matmul_times.append(time_matmuls(engine.runner.model, batch))
        if attention:
            attention_times.append(time_attention(engine))
    return (statistics.median(step_times), statistics.median(matmul_times),
            statistics.median(attention_times) if attention else None)


def decoding_engine(loaded: LoadedModel, batch: int, context: int, max_tokens: int, **config: Any) -> Engine:
    """An engine on `loaded` (EngineConfig `config` beside the bench's batch and KV budget) whose `batch`
    sequences of `context` unrelated prompt tokens are prefilled and have decoded one step: every later step
    decodes them all, greedy, for up to `max_tokens` tokens each. Graphs or a compiled step, when `config` asks
    for them, are left in `engine.runner.graphs`."""
    engine = Engine(loaded, EngineConfig(max_batch_tokens=batch * (context + 1), kv_budget_bytes=2 * 2**30,
                                         **config))
    graphs, engine.runner.graphs = engine.runner.graphs, None  # the prefill runs eagerly
    rng = random.Random(11)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"d{i}", [rng.randrange(100, 40000) for _ in range(context)], params)
    while any(s.is_prefilling or s.output_len == 0 for s in engine.sequences.values()):
        engine.step()
    engine.step()  # warm-up
    engine.runner.graphs = graphs
    return engine


def run(folder: Path, dtype: torch.dtype, batch: int, context: int, steps: int, kv_cache_dtype: str,
        compile_step: bool, warm_buckets: list[int]) -> None:
    loaded = load_model(folder, dtype)
    engine = decoding_engine(loaded, batch, context, 5 * steps + 16, attention="cpu", kv_cache_dtype=kv_cache_dtype,
                             compile="decode" if compile_step else "off")
    compiled = engine.runner.graphs  # the compiled step (cpu backend) when asked for: off until measured
    engine.runner.graphs = None
    name = str(dtype).removeprefix("torch.")
    cache = str(engine.runner.kv.keys[0].dtype).removeprefix("torch.")
    results = {"cpu": measure(engine, batch, steps)}
    compile_times: dict[str, dict[tuple[int, int], float]] = {}
    if isinstance(compiled, CompiledDecode):
        results["cpu+compile"] = measure_compiled(engine, compiled, batch, steps, warm_buckets)
        compile_times["cpu+compile"] = compiled.compile_seconds
    if native.load():
        pack_linears(loaded.model)
        engine.runner.backend = "native"
        engine.step()  # warm-up
        results["native"] = measure(engine, batch, steps, attention=True)
        if isinstance(compiled, CompiledDecode):
            native_compiled = CompiledDecode(loaded.model, engine.runner.kv, compiled.dummy_block, "native")
            results["native+compile"] = measure_compiled(engine, native_compiled, batch, steps, warm_buckets)
            compile_times["native+compile"] = native_compiled.compile_seconds
    else:
        print(f"native unavailable: {native.unavailable_reason()}")
    for backend, (step, matmuls, attention) in results.items():
        print(f"{name:9} kv {cache:9} {backend:14} step {step * 1e3:7.1f} ms   matmuls alone {matmuls * 1e3:6.1f} ms   "
              f"ratio {step / matmuls:4.2f}x", flush=True)
        if attention is not None:  # what of the step is neither: the small ops, the logits tail, the host's glue
            rest = step - matmuls - attention
            print(f"{name:9} kv {cache:9} {backend:14} attention alone {attention * 1e3:6.1f} ms "
                  f"({attention / matmuls:4.2f}x the matmuls)   rest of the step {rest * 1e3:5.1f} ms", flush=True)
    kv_bytes = kv_bytes_read(engine)
    stream = time_stream(kv_bytes)
    matmuls = min(m for _, m, _ in results.values())
    print(f"{name:9} kv {cache:9} floor: the K/V read ({kv_bytes / 2**20:.0f} MiB) streams in {stream * 1e3:.1f} ms "
          f"({kv_bytes / stream / 1e9:.1f} GB/s); matmuls {matmuls * 1e3:.1f} ms + that = "
          f"{(matmuls + stream) / matmuls:4.2f}x the matmuls", flush=True)
    for backend, times in compile_times.items():
        described = ", ".join(f"batch {b} / context {c}: {t:.1f} s" for (b, c), t in sorted(times.items()))
        print(f"{name:9} {backend:14} compile (first call of each bucket): {described}", flush=True)


def measure_compiled(engine: Engine, compiled: CompiledDecode, batch: int, steps: int,
                     warm_buckets: list[int]) -> tuple[float, float, float | None]:
    """The step with `compiled` on: its first step compiles the batch's bucket (timed in
    compile_seconds), then `measure`; the other `warm_buckets` are compiled after, for their times."""
    engine.runner.graphs = compiled
    engine.step()  # compiles (batch bucket, context bucket)
    if compiled.failed is not None:
        raise RuntimeError(f"the compiled step failed: {compiled.failed}")
    result = measure(engine, batch, steps)
    engine.runner.graphs = None
    context = max(s.total_len for s in engine.sequences.values())
    for bucket in warm_buckets:
        compiled.warm_up(bucket, context)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--home", type=Path, default=Path(os.environ.get("TOLLWAY_HOME", ".tollway")))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=380)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--kv-cache-dtypes", default="model,float16,int8",
                        help="TOLLWAY_KV_CACHE_DTYPE values to run the fp32 model with (comma-separated)")
    parser.add_argument("--bf16-kv-cache-dtypes", default="model,int8",
                        help="TOLLWAY_KV_CACHE_DTYPE values to run the bf16 model with, where the CPU computes bf16")
    parser.add_argument("--compile", action="store_true",
                        help="also the torch.compile'd step (TOLLWAY_COMPILE=decode) on both backends")
    parser.add_argument("--warm-buckets", default="",
                        help="with --compile: more batch buckets to compile, for their compile times (e.g. 8,64)")
    args = parser.parse_args()
    warm_buckets = [int(b) for b in args.warm_buckets.split(",") if b]
    torch.set_num_threads(os.cpu_count() or 1)
    folder = resolve_model_folder(args.model, args.home)
    print(f"decode step at batch {args.batch}, ~{args.context}-token contexts, {torch.get_num_threads()} threads; "
          f"CPU flags: {cpu_flags()}; torch {torch.__version__} capability {torch.backends.cpu.get_cpu_capability()}")
    dtypes = [torch.bfloat16] if cpu_has_native_bf16() else []
    for dtype in dtypes:
        for kv_cache_dtype in filter(None, args.bf16_kv_cache_dtypes.split(",")):  # "": none
            run(folder, dtype, args.batch, args.context, args.steps, kv_cache_dtype, args.compile, warm_buckets)
    for kv_cache_dtype in filter(None, args.kv_cache_dtypes.split(",")):  # "": no fp32 run
        run(folder, torch.float32, args.batch, args.context, args.steps, kv_cache_dtype, args.compile, warm_buckets)


if __name__ == "__main__":
    main()
