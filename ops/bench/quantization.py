"""Weight-only quantization on the CPU (issue 22): the linear ops alone, single-stream decode through
the engine offline, and memory, per format (none / int8 / int4), in one run.

1. Linear microbench: this model's projection shapes (qkv 576->960, o 576->576, gate_up 576->3072,
   down 1536->576) at M = 1, 8, 32 rows (`--rows`): `F.linear` on the plain weight, the prepacked
   `PackedLinear` the engine's native path uses (oneDNN bf16 / MKL fp32), and `QuantizedLinear`
   int8 and int4 on each CPU kernel (`torch`: `_weight_int8pack_mm` / `_weight_int4pack_mm_for_cpu`;
   `native`: kernels/cpu/native/quantized_matmul.cpp; `q8`: its int8-activation form as decode steps
   run it, kernels/cpu/native/quantized_q8.cpp: AVX512-VNNI's or AVX2's); median us a call,
   and the sum over the 30 layers' four projections (what one decode step spends in them); in the
   model dtype and fp32. Then the native kernel's two ways (row kernel, dequantize + GEMM) at M = 4..64.
2. Per format, in a fresh process each (so RSS is that format's alone): load, then one request of
   `--tokens` greedy tokens (eos ignored) through `Engine` on its default backend, `--repeats`
   times after a warm-up; decode tok/s = (tokens - 1) / (last token - first token), the best run.
   Memory: the model's weight bytes (parameters, buffers and quantized packings, shared tensors once;
   the engine's prepacked copies included) and the process RSS after load and at the end.

    PYTHONPATH=. .venv/bin/python ops/bench/quantization.py [--dtype auto --tokens 128 --repeats 3]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu import native
from kernels.quantized import cpu as qcpu
from kernels.quantized.layout import quantize_int4, quantize_int8
from workers.engine.engine import Engine, EngineConfig
from workers.models.assets import resolve_model_folder
from workers.models.loader import load_model
from workers.models.packed_linear import PackedLinear, packing_kind
from workers.models.quantize import INT4_GROUP_SIZE, QUANTIZATIONS
from workers.models.quantized_head import QuantizedHead
from workers.models.quantized_linear import QuantizedLinear
from workers.precision import resolve_dtype
from workers.wire.sampling import SamplingParams

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}  # (N, K)
ROWS = (1, 8, 32)
CROSSOVER_ROWS = (4, 8, 16, 32, 64, 128)
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def cpu_flags() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")
            return " ".join(f for f in line.split(":", 1)[1].split() if f in wanted)
    return "?"


def median_us(fns: list[Callable[[torch.Tensor], torch.Tensor]], x: torch.Tensor, round_s: float = 0.02,
              rounds: int = 7) -> float:
    """Median time of a call over `rounds` rounds of about `round_s` each (after a warm-up), the calls
    cycling through `fns` (one per layer: distinct weights, read from memory as a decode step reads them)."""
    start = time.perf_counter()
    for fn in fns:
        fn(x)
    calls = max(len(fns), min(50 * len(fns), int(round_s / max((time.perf_counter() - start) / len(fns), 1e-7))))
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for i in range(calls):
            fns[i % len(fns)](x)
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def layer_copies(n: int, k: int, dtype: torch.dtype, kernels: list[str], copies: int,
                 gen: torch.Generator) -> dict[str, list[Callable[[torch.Tensor], torch.Tensor]]]:
    """`copies` distinct random [n, k] weights in every variant the microbench times."""
    kind = packing_kind(dtype)
    variants: dict[str, list[Callable[[torch.Tensor], torch.Tensor]]] = {}
    for _ in range(copies):
        w = torch.randn(n, k, generator=gen) * 0.02
        plain = nn.Linear(k, n, bias=False)
        plain.weight.data = w.to(dtype)
        variants.setdefault("linear", []).append(functools.partial(F.linear, weight=plain.weight))
        if kind:
            variants.setdefault("packed", []).append(PackedLinear(plain, kind, batch_hint=32))
        q8, q4 = quantize_int8(w), quantize_int4(w, INT4_GROUP_SIZE)
        for kern in kernels:
            variants.setdefault(f"i8-{kern}", []).append(QuantizedLinear(q8, None, dtype, kernel=kern))
            variants.setdefault(f"i4-{kern}", []).append(QuantizedLinear(q4, None, dtype, kernel=kern))
        if "native" in kernels and qcpu.int8_activations(dtype, k):  # as a decode step runs them
            variants.setdefault("i8-q8", []).append(in_decode_step(QuantizedLinear(q8, None, dtype, kernel="native")))
            variants.setdefault("i4-q8", []).append(in_decode_step(QuantizedLinear(q4, None, dtype, kernel="native")))
    return variants


def in_decode_step(linear: QuantizedLinear) -> Callable[[torch.Tensor], torch.Tensor]:
    """The linear called as a decode step calls it: its int8-activation kernel below the crossover."""
    def call(x: torch.Tensor) -> torch.Tensor:
        with qcpu.decode_step():
            return linear(x)
    return call


@torch.inference_mode()
def microbench(dtype: torch.dtype, layers: int, rows: tuple[int, ...] = ROWS) -> None:
    name = str(dtype).removeprefix("torch.")
    kernels = ["torch", *(["native"] if native.load() else [])]
    print(f"\nlinear ops, {name}, us per call (median, cycling through {layers} distinct weights per shape as "
          f"the layers of a step do); 'all' = {layers} layers x the four projections")
    totals: dict[tuple[int, str], float] = {}
    gen = torch.Generator().manual_seed(0)
    for index, (label, (n, k)) in enumerate(SHAPES.items()):
        variants = layer_copies(n, k, dtype, kernels, layers, gen)
        if index == 0:
            print(f"{'shape':>16} {'M':>3} " + " ".join(f"{v:>8}" for v in variants))
        for m in rows:
            x = torch.randn(m, k, generator=gen).to(dtype)
            times = {v: median_us(fns, x) for v, fns in variants.items()}
            for v, t in times.items():
                totals[(m, v)] = totals.get((m, v), 0.0) + t * layers
            print(f"{label + f' {k}->{n}':>16} {m:>3} " + " ".join(f"{t:8.1f}" for t in times.values()), flush=True)
        del variants
    for m in rows:
        print(f"{'all':>16} {m:>3} " + " ".join(f"{t:8.0f}" for (mm, _), t in totals.items() if mm == m))


@torch.inference_mode()
def crossover(dtype: torch.dtype, layers: int) -> None:
    """The native kernel's two ways at growing M: the row kernel vs dequantize + one GEMM, summed
    over the four projections x `layers` (what `dequantize_from_rows` chooses between)."""
    print(f"\nnative kernel, {str(dtype).removeprefix('torch.')}: row kernel vs dequantize + GEMM, us for all "
          f"{layers} layers' projections")
    print(f"{'M':>4} {'i8 rows':>9} {'i8 deq':>9} {'i4 rows':>9} {'i4 deq':>9}")
    gen = torch.Generator().manual_seed(1)
    sums = {m: [0.0, 0.0, 0.0, 0.0] for m in CROSSOVER_ROWS}
    saved, saved_q8 = qcpu.DEQUANTIZE_FROM_ROWS, qcpu.Q8_DEQUANTIZE_FROM_ROWS  # the int8-activation kernels' too
    try:
        for n, k in SHAPES.values():
            variants = layer_copies(n, k, dtype, ["native"], layers, gen)
            for m in CROSSOVER_ROWS:
                x = torch.randn(m, k, generator=gen).to(dtype)
                for j, (name, threshold) in enumerate((("i8-native", 10**9), ("i8-native", 1), ("i4-native", 10**9),
                                                       ("i4-native", 1))):
                    qcpu.DEQUANTIZE_FROM_ROWS = {key: threshold for key in saved}
                    qcpu.Q8_DEQUANTIZE_FROM_ROWS = {key: threshold for key in saved_q8}
                    sums[m][j] += median_us(variants[name], x) * layers
            del variants
    finally:
        qcpu.DEQUANTIZE_FROM_ROWS, qcpu.Q8_DEQUANTIZE_FROM_ROWS = saved, saved_q8
    for m in CROSSOVER_ROWS:
        print(f"{m:>4} " + " ".join(f"{s:9.0f}" for s in sums[m]), flush=True)


def rss_mb() -> tuple[float, float]:
    """(VmRSS, VmHWM) of this process in MiB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def weight_bytes(model: nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        try:
            key, size = tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes()
        except NotImplementedError:  # oneDNN's prepacked weights are opaque: count their elements
            key, size = id(tensor), tensor.numel() * tensor.element_size()
        if key not in seen:
            seen.add(key)
            total += size
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            total += module.nbytes() - (module.bias.numel() * module.bias.element_size() if module.bias is not None else 0)
        elif isinstance(module, QuantizedHead):  # its int8 copy (the float head is a parameter, counted above)
            total += module.nbytes()
    return total


def child(folder: Path, dtype_name: str, quantization: str, tokens: int, repeats: int) -> dict[str, float | str]:
    """One format in this process: load, decode, measure; returns the figures."""
    start = time.perf_counter()
    loaded = load_model(folder, resolve_dtype(dtype_name), "cpu", quantization)
    load_s = time.perf_counter() - start
    rss_loaded, _ = rss_mb()
    engine = Engine(loaded, EngineConfig(kv_budget_bytes=256 * 2**20))
    prompt = loaded.tokenizer.encode(PROMPT)

    def one(max_tokens: int, request_id: str) -> float:
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        stamps = []
        while engine.has_work():
            for delta in engine.step():
                stamps.extend([time.perf_counter()] * len(delta.token_ids))
        if len(stamps) != max_tokens:
            raise RuntimeError(f"expected {max_tokens} tokens, got {len(stamps)}")
        return (max_tokens - 1) / (stamps[-1] - stamps[0])

    one(16, "warm-up")
    rates = [one(tokens, f"r{i}") for i in range(repeats)]
    rss_end, rss_peak = rss_mb()
    return {"load_s": load_s, "weights_mb": weight_bytes(loaded.model) / 2**20, "rss_loaded_mb": rss_loaded,
            "rss_end_mb": rss_end, "rss_peak_mb": rss_peak, "tok_s": max(rates), "tok_s_median": statistics.median(rates),
            "backend": str(engine.runner.backend)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--home", type=Path, default=Path(os.environ.get("TOLLWAY_HOME", ".tollway")))
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--formats", default=",".join(QUANTIZATIONS))
    parser.add_argument("--skip-micro", action="store_true")
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: every core)")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="the microbench's M values (comma-separated)")
    parser.add_argument("--child", choices=QUANTIZATIONS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    folder = resolve_model_folder(args.model, args.home)
    if args.child:
        print(json.dumps(child(folder, args.dtype, args.child, args.tokens, args.repeats)))
        return
    dtype = resolve_dtype(args.dtype)
    print(f"quantization bench: {args.model} in {str(dtype).removeprefix('torch.')}, {torch.get_num_threads()} "
          f"threads; CPU flags: {cpu_flags()}; torch {torch.__version__} capability "
          f"{torch.backends.cpu.get_cpu_capability()}")
    if not args.skip_micro:
        layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
        for micro_dtype in dict.fromkeys([dtype, torch.float32]):  # fp32 too: what AVX2-only hosts run
            microbench(micro_dtype, layers, tuple(int(m) for m in args.rows.split(",")))
            if native.load():
                crossover(micro_dtype, layers)
    if args.skip_decode:
        return
    print(f"\nsingle-stream decode, one request of {args.tokens} tokens (best of {args.repeats}), engine offline")
    print(f"{'format':>6} {'backend':>7} {'load s':>6} {'weights MiB':>11} {'RSS loaded':>10} {'RSS end':>8} "
          f"{'RSS peak':>8} {'tok/s':>7} {'median':>7} {'x none':>6}")
    base = None
    for fmt in args.formats.split(","):
        command = [sys.executable, str(Path(__file__).resolve()), "--child", fmt, "--model", args.model,
                   "--home", str(args.home), "--dtype", args.dtype, "--tokens", str(args.tokens),
                   "--repeats", str(args.repeats), "--threads", str(args.threads)]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode:
            print(f"{fmt:>6} failed:\n{done.stderr[-2000:]}")
            continue
        r = json.loads(done.stdout.strip().splitlines()[-1])
        base = base or (r["tok_s"] if fmt == "none" else None)
        ratio = f"{r['tok_s'] / base:6.2f}" if base else "     -"
        print(f"{fmt:>6} {r['backend']:>7} {r['load_s']:6.1f} {r['weights_mb']:11.1f} {r['rss_loaded_mb']:10.0f} "
              f"{r['rss_end_mb']:8.0f} {r['rss_peak_mb']:8.0f} {r['tok_s']:7.1f} {r['tok_s_median']:7.1f} {ratio}",
              flush=True)


if __name__ == "__main__":
    main()
