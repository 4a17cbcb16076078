"""The engine on a GPU: CUDA-graphed decode against eager and against transformers (issue 21), and
quantized weights in one stream (issue 22).

A device machine holds no copy of the weights, so the model is a random-weight Llama in the default
model's geometry (SmolLM2-135M: 30 layers, hidden 576, 9 query / 3 KV heads of 64, vocabulary 49,152,
tied embeddings); the speed of a step does not depend on the weights' values. Parts (`--parts`):

- `workloads`: engine_gsp.py's shared-prefix and no-sharing workloads (4 x 8, 350 + 30 prompt tokens,
  32 out) through the engine eager, with CUDA graphs and 1,024-token steps (the CPU's budget), and
  with CUDA graphs at the device's default step budget, and that with overlapped steps (the default on
  CUDA; the other modes turn it off); transformers' static `generate` in fp32
  and bf16; output tok/s, and each engine mode over the best transformers mode.
- `step`: the engine's decode step at batch 32 (~380-token contexts), eager, graphed and graphed with
  overlapped steps (workers/engine/overlap.py: the host schedules step N+1 while the GPU runs N): wall time,
  the GPU's busy time inside it (kernel intervals from the torch profiler, merged), and the busy
  share of the wall; also the captured graph replayed alone (the step's GPU time with no host work),
  and with `--host-profile N` where the graphed step's host time goes.
- `single`: one stream (40-token prompt, 128 tokens) per weight format, graphed: output tok/s after
  the first token, and the GPU memory the weights take (allocated after loading).

    python3 ops/bench/gpu_engine.py [--parts workloads,step,single] [--formats none,int8,int4]

Without CUDA it runs on the CPU with 2 layers (a smoke test of the script; no figure means anything).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, cast

import torch
from transformers import AutoModelForCausalLM

from ops.bench.engine_gsp import KV_BUDGET, run_engine, run_hf_static, workload
from workers.engine.config import EngineConfig, OverlapMode
from workers.engine.cuda_graphs import DecodeGraphs
from workers.engine.engine import Engine
from workers.models.loader import load_model
from workers.models.tiny import write_tiny_model_folder
from workers.wire.sampling import SamplingParams

SMOLLM2_GEOMETRY = {
    "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "max_position_embeddings": 8192,
    "rope_theta": 100000.0, "tie_word_embeddings": True,
}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def busy_seconds(prof: torch.profiler.profile) -> float:
    """The union of the device kernels' intervals in a profile, in seconds (0 without CUDA)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    total, end = 0.0, float("-inf")
    for start, stop in spans:
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total * 1e-6


# (name, CUDA graphs, step token budget (None: the engine's default on the device, STEP_TOKENS), overlapped steps)
ENGINE_MODES: list[tuple[str, bool, int | None, OverlapMode]] = [("eager", False, None, "off"), ("graphs, 1024-token steps", True, 1024, "off"),
                ("graphs", True, None, "off"), ("graphs + overlap", True, None, "on")]
STEP_MODES: list[tuple[str, bool, OverlapMode]] = [("eager", False, "off"), ("graphs", True, "off"), ("graphs + overlap", True, "on")]


def workloads(folder: Path, dtype: torch.dtype, device: str) -> None:
    loaded = load_model(folder, dtype, device)
    auto = cast(Any, AutoModelForCausalLM)
    hf = {dt: auto.from_pretrained(folder, dtype=dt).to(device).eval() for dt in (torch.float32, torch.bfloat16)}
    for shared in (True, False):
        prompts = workload(shared, 4, 8, 350, 30, seed=1)
        print(f"\n{'shared-prefix' if shared else 'no-sharing'} workload (4 x 8, 350 + 30 tokens, 32 out)")
        print(f"{'mode':34} {'out tok/s':>9} {'tot tok/s':>9} {'TTFT p50':>8} {'TTFT p99':>8}  (seconds)")
        rates = {}
        for mode, graphs, step_tokens, overlap in ENGINE_MODES * 2:  # each twice, interleaved: the first warms up
            config = EngineConfig(max_batch_tokens=step_tokens, kv_budget_bytes=KV_BUDGET, cuda_graphs=graphs,
                                  overlap=overlap)
            result = run_engine(loaded, prompts, 32, f"tollway engine {mode}", config)
            rates[mode] = result.output_tokens / result.seconds
            print(result.row(), flush=True)
        best = 0.0
        for dt, model in hf.items():
            for _ in range(2):
                result = run_hf_static(model, prompts, 32, f"transformers static {str(dt)[6:]}")
                print(result.row(), flush=True)
            best = max(best, result.output_tokens / result.seconds)
        print("engine / best transformers: " + ", ".join(f"{mode} {rate / best:.2f}x" for mode, rate in rates.items()))


def decode_step(folder: Path, dtype: torch.dtype, device: str, host_profile: int, batch: int = 32,
                context: int = 380, steps: int = 20) -> None:
    loaded = load_model(folder, dtype, device)
    print(f"\ndecode step at batch {batch}, ~{context}-token contexts ({steps} steps)")
    for name, graphs, overlap in STEP_MODES:
        engine = Engine(loaded, EngineConfig(max_batch_tokens=batch * (context + 1), kv_budget_bytes=KV_BUDGET,
                                             cuda_graphs=graphs, overlap=overlap))
        params = SamplingParams(max_tokens=3 * steps + 8, temperature=0.0, ignore_eos=True)
        for i, prompt in enumerate(workload(False, batch, 1, context, 0, seed=11)):
            engine.add_request(f"d{i}", prompt, params)
        while any(s.is_prefilling or s.output_len == 0 for s in engine.sequences.values()):
            engine.step()
        for _ in range(3):  # warm: the graph's capture, Triton's compiles
            engine.step()
        sync()
        walls = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - start)
        # Only the device's activity is traced (CUPTI): recording every host op too would slow the host,
        # which is what the overlapped step hides the GPU behind, and understate the busy share.
        activities = [torch.profiler.ProfilerActivity.CUDA if torch.cuda.is_available()
                      else torch.profiler.ProfilerActivity.CPU]
        with torch.profiler.profile(activities=activities) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            sync()
            profiled_wall = time.perf_counter() - start
        busy = busy_seconds(prof)
        assert engine.num_running == batch, "every sequence must decode in each measured step"
        if graphs and host_profile:  # with overlap too: the host's time per step, now beside the GPU's
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(steps):
                engine.step()
            profiler.disable()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(host_profile)
        print(f"  {name:16}: step {statistics.median(walls) * 1e3:6.2f} ms (median), under the profiler "
              f"{profiled_wall / steps * 1e3:6.2f} ms with the GPU busy {busy / steps * 1e3:5.2f} ms "
              f"= {busy / profiled_wall:5.1%} of the wall ({busy / steps / statistics.median(walls):5.1%} of the "
              f"unprofiled median)", flush=True)
        captured = engine.runner.graphs
        if overlap == "off" and graphs and isinstance(captured, DecodeGraphs) and captured.graphs \
                and torch.cuda.is_available():
            graph = next(iter(captured.graphs.values())).graph
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(steps):
                graph.replay()
            end.record()
            sync()
            print(f"          the captured step replayed alone: {begin.elapsed_time(end) / steps:6.2f} ms of GPU time; "
                  f"graphs captured: {sorted(captured.graphs)}", flush=True)


def single_stream(folder: Path, dtype: torch.dtype, device: str, formats: list[str], output: int = 128) -> None:
    print(f"\none stream, 40-token prompt, {output} tokens, CUDA graphs on")
    prompt = [1000 + i for i in range(40)]
    for fmt in formats:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            before = torch.cuda.memory_allocated()
        loaded = load_model(folder, dtype, device, quantization=fmt)
        weights = (torch.cuda.memory_allocated() - before) / 2**20 if torch.cuda.is_available() else float("nan")
        rates = []
        for _ in range(3):
            engine = Engine(loaded, EngineConfig(max_batch_tokens=1024, kv_budget_bytes=256 * 2**20, cuda_graphs=True))
            seq = engine.add_request("s", prompt, SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True))
            engine.step()  # the prefill
            sync()
            start = time.perf_counter()
            while not seq.finished:
                engine.step()
            rates.append((seq.output_len - 1) / (time.perf_counter() - start))
            del engine
        print(f"  {fmt:5}: {' '.join(f'{r:7.1f}' for r in rates)} tok/s (the first round captures); "
              f"weights on the GPU {weights:6.1f} MiB", flush=True)
        del loaded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="workloads,step,single")
    parser.add_argument("--formats", default="none,int8,int4")
    parser.add_argument("--host-profile", type=int, default=0, metavar="N",
                        help="print the N functions of most host time in graphed decode steps (cProfile)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    geometry = dict(SMOLLM2_GEOMETRY)
    if device == "cpu":
        geometry["num_hidden_layers"] = 2
    folder = write_tiny_model_folder(Path(tempfile.mkdtemp()) / "smollm2-random", "llama", seed=0, **geometry)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (smoke test)"
    print(f"device {name}, torch {torch.__version__}, engine dtype {str(dtype)[6:]}, "
          f"{geometry['num_hidden_layers']} layers (random weights)", flush=True)
    parts = args.parts.split(",")
    if "workloads" in parts:
        workloads(folder, dtype, device)
    if "step" in parts:
        decode_step(folder, dtype, device, args.host_profile)
    if "single" in parts:
        single_stream(folder, dtype, device, args.formats.split(","))


if __name__ == "__main__":
    main()
