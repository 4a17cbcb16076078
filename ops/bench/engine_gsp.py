"""Engine throughput on a generated-shared-prefix workload and a no-sharing one, against transformers.

Workload (as SGLang's bench_serving "generated-shared-prefix"): G groups x P prompts; each group
shares a system prompt of S random tokens, each prompt adds Q random question tokens; O output
tokens each (stop tokens ignored, for equal work); all submitted at once. The no-sharing workload
has the same sizes with every prompt unique. In the same run: tollway's engine (precision `auto`),
transformers' static batched `generate` in fp32 and bf16, and its continuous-batching
`generate_batch`. Also: TTFT of a request whose system prompt is cached vs a cold one, and the
engine's decode step at batch 32 against a roofline of the model's matmuls alone.

    .venv/bin/python ops/bench/engine_gsp.py [--groups 4 --per-group 8 --system 350 --question 30 --output 32]
        [--device auto|cpu|cuda]

On a GPU the engine's attention runs through the Triton kernels, and every model lives on the GPU.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, GenerationConfig

from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.engine.request import Sequence
from workers.models.assets import resolve_model_folder
from workers.models.llama import DecoderLayer
from workers.models.loader import LoadedModel, load_model
from workers.precision import DEVICE_CHOICES, resolve_device, resolve_dtype
from workers.wire.sampling import SamplingParams

KV_BUDGET = 2 * 2**30  # the engine's default: room for every sequence of the workloads at once


def ttft(seq: Sequence) -> float:
    """Seconds from arrival to first token of a sequence that has produced one."""
    if seq.first_token_time is None:
        raise RuntimeError(f"{seq.request_id} finished without a token")
    return seq.first_token_time - seq.arrival_time


@dataclass
class Result:
    name: str
    seconds: float
    prompt_tokens: int
    output_tokens: int
    ttft: list[float]
    hit_rate: float | None = None
    kv_utilization: float | None = None

    def row(self) -> str:
        p50 = statistics.median(self.ttft)
        p99 = sorted(self.ttft)[min(len(self.ttft) - 1, int(0.99 * len(self.ttft)))]
        extra = ""
        if self.hit_rate is not None:
            extra = f"  hit {self.hit_rate:5.1%}  KV util at peak {self.kv_utilization:5.1%}"
        return (f"{self.name:34} {self.output_tokens / self.seconds:9.1f} {(self.prompt_tokens + self.output_tokens) / self.seconds:9.1f}"
                f" {p50:8.2f} {p99:8.2f}{extra}")


def workload(shared: bool, groups: int, per_group: int, system: int, question: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(n)]

    prompts = []
    for _ in range(groups):
        prefix = tokens(system)
        for _ in range(per_group):
            prompts.append((prefix if shared else tokens(system)) + tokens(question))
    return prompts


def run_engine(loaded: LoadedModel, prompts: list[list[int]], output: int, name: str,
               config: EngineConfig | None = None) -> Result:
    engine = Engine(loaded, config or EngineConfig(max_batch_tokens=1024, kv_budget_bytes=KV_BUDGET))
    params = SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    seqs = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    peak_blocks, util_at_peak = 0, 0.0
    while engine.has_work():
        engine.step()
        held, capacity = engine.kv_utilization()
        if capacity // engine.pool.block_size > peak_blocks:
            peak_blocks, util_at_peak = capacity // engine.pool.block_size, held / capacity
    seconds = time.perf_counter() - start
    engine.check_integrity()
    prompt_tokens = sum(len(p) for p in prompts)
    return Result(name, seconds, prompt_tokens, sum(s.output_len for s in seqs),
                  [ttft(s) for s in seqs],
                  sum(s.prompt_cached_len for s in seqs) / prompt_tokens, util_at_peak)


@torch.inference_mode()
def run_hf_static(model, prompts: list[list[int]], output: int, name: str) -> Result:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=model.device)  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    config = GenerationConfig(do_sample=False, pad_token_id=0, eos_token_id=None)
    start = time.perf_counter()
    model.generate(ids, attention_mask=mask, generation_config=config, max_new_tokens=1, min_new_tokens=1)
    ttft = time.perf_counter() - start  # every prompt's first token comes out of the one prefill
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, generation_config=config, max_new_tokens=output,
                         min_new_tokens=output)
    seconds = time.perf_counter() - start
    return Result(name, seconds, sum(len(p) for p in prompts), (out.shape[1] - width) * len(prompts),
                  [ttft] * len(prompts))


def run_hf_generate_batch(model, prompts: list[list[int]], output: int) -> Result:
    config = GenerationConfig(do_sample=False, max_new_tokens=output, eos_token_id=None, pad_token_id=0)
    start = time.perf_counter()
    results = model.generate_batch(prompts, generation_config=config, record_timestamps=True, warmup=False)
    seconds = time.perf_counter() - start
    outs = list(results.values())
    ttfts = [o.timestamps[0] - o.created_time if o.timestamps else seconds for o in outs]
    return Result("transformers generate_batch", seconds, sum(len(p) for p in prompts),
                  sum(len(o.generated_tokens) for o in outs), ttfts)


def cached_vs_cold_ttft(loaded: LoadedModel, system: int, question: int) -> tuple[float, float]:
    prompts = workload(True, 1, 3, system, question, seed=7)
    engine = Engine(loaded, EngineConfig(max_batch_tokens=1024, kv_budget_bytes=KV_BUDGET))
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    ttfts = []
    for i, prompt in enumerate(prompts):  # one at a time: the first is cold, the others hit its system prompt
        seq = engine.add_request(f"t{i}", prompt, params)
        while engine.has_work():
            engine.step()
        ttfts.append(ttft(seq))
    return ttfts[0], min(ttfts[1:])


def decode_step_vs_roofline(loaded: LoadedModel, batch: int, context: int, repeats: int = 10) -> tuple[float, float]:
    """Median engine decode step with `batch` sequences at ~`context` tokens, and the best time of
    the same step's matmuls alone (every layer's four projections + the LM head on [batch, hidden])."""
    engine = Engine(loaded, EngineConfig(max_batch_tokens=batch * (context + 1), kv_budget_bytes=KV_BUDGET))
    params = SamplingParams(max_tokens=repeats + 4, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(workload(False, batch, 1, context, 0, seed=11)):
        engine.add_request(f"d{i}", p, params)
    while any(s.is_prefilling or s.output_len == 0 for s in engine.sequences.values()):
        engine.step()
    times: list[float] = []
    while len(times) < repeats:
        assert engine.num_running == batch, "every sequence must decode in each measured step"
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    model = loaded.model
    x = torch.randn(batch, model.config.hidden_size, dtype=model.dtype, device=model.device)
    gate_up = torch.randn(batch, model.config.intermediate_size, dtype=model.dtype, device=model.device)
    q = torch.randn(batch, model.config.q_size, dtype=model.dtype, device=model.device)

    layers = cast(list[DecoderLayer], list(model.layers))

    def matmuls() -> None:
        for layer in layers:
            F.linear(x, layer.qkv_proj.weight, layer.qkv_proj.bias)
            F.linear(q, layer.o_proj.weight)
            F.linear(x, layer.gate_up_proj.weight)
            F.linear(gate_up, layer.down_proj.weight)
        F.linear(x, model.lm_head.weight)

    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            matmuls()
            if model.device.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
    return statistics.median(times), best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--home", type=Path, default=Path(os.environ.get("TOLLWAY_HOME", ".tollway")))
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--per-group", type=int, default=8)
    parser.add_argument("--system", type=int, default=350)
    parser.add_argument("--question", type=int, default=30)
    parser.add_argument("--output", type=int, default=32)
    parser.add_argument("--skip-generate-batch", action="store_true", help="skip transformers generate_batch")
    parser.add_argument("--device", choices=DEVICE_CHOICES, default="auto")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    folder = resolve_model_folder(args.model, args.home)
    device = resolve_device(args.device)
    dtype = resolve_dtype("auto", device)
    ours = load_model(folder, dtype, device)
    auto = cast(Any, AutoModelForCausalLM)  # transformers' decorator hides from_pretrained's signature
    hf = {dt: auto.from_pretrained(folder, dtype=dt).to(device).eval()
          for dt in (torch.float32, torch.bfloat16)}
    print(f"device={device}  threads={torch.get_num_threads()}  engine dtype={str(dtype).removeprefix('torch.')}  "
          f"{args.groups} groups x {args.per_group} prompts, system {args.system} + question {args.question} "
          f"tokens, {args.output} output tokens, all submitted at once")
    for shared in (True, False):
        prompts = workload(shared, args.groups, args.per_group, args.system, args.question, seed=1)
        print(f"\n{'shared-prefix' if shared else 'no-sharing'} workload")
        print(f"{'mode':34} {'out tok/s':>9} {'tot tok/s':>9} {'TTFT p50':>8} {'TTFT p99':>8}  (seconds)")
        results = [run_engine(ours, prompts, args.output, "tollway engine")]
        print(results[-1].row(), flush=True)
        for dt, model in hf.items():
            results.append(run_hf_static(model, prompts, args.output, f"transformers static {str(dt)[6:]}"))
            print(results[-1].row(), flush=True)
        if not args.skip_generate_batch:
            results.append(run_hf_generate_batch(hf[torch.float32], prompts, args.output))
            print(results[-1].row(), flush=True)
        best_hf = max(r.output_tokens / r.seconds for r in results[1:])
        engine_rate = results[0].output_tokens / results[0].seconds
        print(f"engine / best transformers mode (output tok/s): {engine_rate / best_hf:.2f}x")
    cold, warm = cached_vs_cold_ttft(ours, args.system, args.question)
    print(f"\nTTFT one request at a time: cold {cold * 1e3:.0f} ms, system prompt cached {warm * 1e3:.0f} ms "
          f"(ratio {warm / cold:.2f})")
    step, roofline = decode_step_vs_roofline(ours, 32, args.system + args.question)
    print(f"decode step at batch 32, ~{args.system + args.question}-token contexts: {step * 1e3:.1f} ms; "
          f"matmuls alone {roofline * 1e3:.1f} ms (step / roofline {step / roofline:.2f}x)")


if __name__ == "__main__":
    main()
