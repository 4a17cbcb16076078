"""MoE decode against a dense model of the same active FLOPs (issue 26), on the engine, in one run.

Three random-weight models, built with transformers' config and model classes and `save_pretrained`
(nothing downloaded), identical but for the feed-forward:

- `moe`: `--experts` experts of `--expert-size` inner width per layer, top-`--top-k` routing
  (Mixtral, or Qwen3-MoE with `--family qwen3_moe`);
- `dense-active`: one dense MLP of top-k × expert-size inner width (Mistral, or Qwen3): per token the
  same multiply-adds as the MoE's active experts (the router's H × E aside);
- `dense-total`: one dense MLP of experts × expert-size (all the MoE's weights in one matrix): what a
  decode batch that touches every expert must read anyway.

Each is loaded in fp32 (`auto` is fp32 on a CPU without native bf16) and an engine per model
prefills `--batch` unrelated prompts of `--context` tokens; then, `--steps` rounds, each model in
turn runs one timed decode step followed by one timing of its feed-forward alone (every layer's
`mlp` on a [batch, hidden] input); medians per model.
The figures that matter are ratios within this run: MoE / dense-active (the cost of sparsity at this
batch) and MoE / dense-total (the expert dispatch's overhead at equal bytes). A small word-level
tokenizer keeps the LM head from dominating the step.

    PYTHONPATH=$PWD .venv/bin/python ops/bench/moe_decode.py [--family mixtral] [--batch 32] [--steps 15]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer, models

from ops.bench.decode_step import cpu_flags
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.models.llama import LlamaForCausalLM
from workers.models.loader import load_model
from workers.models.moe import SparseMoE
from workers.wire.sampling import SamplingParams

FAMILIES = {"mixtral": ("Mixtral", "Mistral"), "qwen3_moe": ("Qwen3Moe", "Qwen3")}


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    vocab = {f"t{i}": i for i in range(vocab_size)}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(folder / "tokenizer.json"))


def write_model(folder: Path, prefix: str, fields: dict[str, Any], seed: int) -> Path:
    torch.manual_seed(seed)  # transformers' own initialisation (router std 0.02: near-uniform routing)
    config = getattr(transformers, f"{prefix}Config")(**fields)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config)
    model.save_pretrained(folder)
    write_tokenizer(folder, fields["vocab_size"])
    return folder


def build_models(root: Path, args: argparse.Namespace) -> dict[str, Path]:
    moe_prefix, dense_prefix = FAMILIES[args.family]
    common = dict(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                  num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
                  max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                  sliding_window=None)
    if args.family == "mixtral":
        moe = dict(intermediate_size=args.expert_size, num_local_experts=args.experts)
    else:
        moe = dict(moe_intermediate_size=args.expert_size, intermediate_size=args.expert_size, num_experts=args.experts,
                   norm_topk_prob=True)
    return {
        "moe": write_model(root / "moe", moe_prefix, {**common, **moe, "num_experts_per_tok": args.top_k}, 1),
        "dense-active": write_model(root / "dense-active", dense_prefix,
                                    {**common, "intermediate_size": args.top_k * args.expert_size}, 2),
        "dense-total": write_model(root / "dense-total", dense_prefix,
                                   {**common, "intermediate_size": args.experts * args.expert_size}, 3),
    }


@torch.inference_mode()
def time_ffn(model: LlamaForCausalLM, batch: int) -> float:
    """Every layer's feed-forward once on [batch, hidden] (the step's normed input's shape)."""
    x = torch.randn(batch, model.config.hidden_size, dtype=model.dtype)
    start = time.perf_counter()
    for layer in model.layers:
        layer.mlp(x)  # type: ignore[operator]
    return time.perf_counter() - start


@torch.inference_mode()
def experts_touched(model: LlamaForCausalLM, batch: int) -> float:
    """Mean experts (per layer) that receive at least one of `batch` random tokens."""
    counts = []
    for layer in model.layers:
        moe = getattr(layer, "moe", None)
        assert isinstance(moe, SparseMoE)
        x = torch.randn(batch, model.config.hidden_size, dtype=model.dtype)
        chosen = moe.router(x).topk(moe.top_k, dim=-1).indices
        counts.append(len(chosen.unique()))
    return statistics.mean(counts)


def start(folder: Path, args: argparse.Namespace) -> tuple[Engine, LlamaForCausalLM]:
    """An engine on `folder` with `--batch` prompts prefilled, every sequence decoding."""
    loaded = load_model(folder, torch.float32)
    engine = Engine(loaded, EngineConfig(max_batch_tokens=args.batch * (args.context + 1),
                                         kv_budget_bytes=256 * 2**20, attention=args.attention))
    rng = random.Random(7)
    params = SamplingParams(max_tokens=args.steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"r{i}", [rng.randrange(3, args.vocab) for _ in range(args.context)], params)
    while any(s.is_prefilling or s.output_len == 0 for s in engine.sequences.values()):
        engine.step()
    engine.step()  # warm-up
    return engine, loaded.model


def measure(engines: dict[str, tuple[Engine, LlamaForCausalLM]], args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Median decode step and FFN-alone time per model. The models take turns within each round, so
    a change in the host's load reaches all three alike and the ratios stay comparable."""
    steps: dict[str, list[float]] = {name: [] for name in engines}
    ffn: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.steps):
        for name, (engine, model) in engines.items():
            if engine.num_running != args.batch:
                raise RuntimeError("every sequence must decode in each measured step")
            begin = time.perf_counter()
            engine.step()
            steps[name].append(time.perf_counter() - begin)
            ffn[name].append(time_ffn(model, args.batch))
    results = {}
    for name, (_, model) in engines.items():
        results[name] = {"step_ms": statistics.median(steps[name]) * 1e3, "ffn_ms": statistics.median(ffn[name]) * 1e3,
                         "params_m": sum(p.numel() for p in model.parameters()) / 1e6}
        if model.config.num_experts:
            results[name]["experts_touched"] = experts_touched(model, args.batch)
    return results


def active_ffn_macs(args: argparse.Namespace) -> dict[str, int]:
    """Multiply-adds per token of one layer's feed-forward (router included for the MoE)."""
    h, i = args.hidden, args.expert_size
    return {"moe": 3 * h * i * args.top_k + h * args.experts, "dense-active": 3 * h * i * args.top_k,
            "dense-total": 3 * h * i * args.experts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=sorted(FAMILIES), default="mixtral")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--expert-size", type=int, default=1536)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=15, help="measured rounds (one step of each model)")
    parser.add_argument("--attention", default="cpu", help="engine attention backend, the same for all three")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = every core)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    transformers.utils.logging.disable_progress_bar()
    print(f"{args.family}: hidden {args.hidden}, {args.layers} layers, {args.heads}/{args.kv_heads} heads, "
          f"{args.experts} experts x {args.expert_size} top-{args.top_k}, vocab {args.vocab}; decode at batch "
          f"{args.batch}, {args.context}-token prompts, fp32, attention {args.attention}, "
          f"{torch.get_num_threads()} threads; CPU flags: {cpu_flags()}; torch {torch.__version__}", flush=True)
    macs = active_ffn_macs(args)
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="tollway-moe-bench-") as tmp:
        began = time.perf_counter()
        folders = build_models(Path(tmp), args)
        print(f"models built in {time.perf_counter() - began:.0f} s", flush=True)
        engines = {}
        for name, folder in folders.items():
            engines[name] = start(folder, args)
            print(f"{name}: loaded and prefilled at {time.perf_counter() - began:.0f} s", flush=True)
    results = measure(engines, args)
    for name, r in results.items():
        touched = f"   experts touched/layer {r['experts_touched']:.1f} of {args.experts}" \
            if "experts_touched" in r else ""
        print(f"{name:13} {r['params_m']:7.1f} M params   FFN MACs/token/layer {macs[name] / 1e6:5.2f} M   "
              f"step {r['step_ms']:7.1f} ms ({args.batch / r['step_ms'] * 1e3:6.1f} tok/s)   "
              f"FFN alone {r['ffn_ms']:6.1f} ms{touched}", flush=True)
    moe, active, total = results["moe"], results["dense-active"], results["dense-total"]
    print(f"MoE / dense-active (same active FLOPs): step {moe['step_ms'] / active['step_ms']:.2f}x, "
          f"FFN {moe['ffn_ms'] / active['ffn_ms']:.2f}x")
    print(f"MoE / dense-total (same weights):       step {moe['step_ms'] / total['step_ms']:.2f}x, "
          f"FFN {moe['ffn_ms'] / total['ffn_ms']:.2f}x")


if __name__ == "__main__":
    main()
