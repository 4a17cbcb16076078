"""Gemma-style mixed windows (issue 26): one block table per layer group against one table for all
layers, in the same KV budget.

A random-weight Gemma 3 text model in the default model's geometry (hidden 576, 9 query / 3 KV heads
of 64) with `--layers` layers, one full layer in six and the rest sliding with `--window`, is saved
with the default model's tokenizer (nothing downloaded). Per layout, a fresh engine with
`--budget-mib` of KV runs `--streams` greedy requests of a 64-token prompt asking `--output` tokens
each; printed: the cache's pages, the tokens each request got before the cache could not hold it
(`length`), and the decode rate. The single-table layout is what the engine used before the
groups (and a compiled decode step still uses).

    PYTHONPATH=. .venv/bin/python ops/bench/mixed_windows.py --home .tollway [--budget-mib 32 --output 3000]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
import transformers

from cache.kv_layout import KVLayout
from ops.bench.quantization import cpu_flags
from workers.engine import runner_setup
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.models.assets import resolve_model_folder
from workers.models.loader import load_model
from workers.wire.sampling import SamplingParams


def write_model(folder: Path, tokenizer_from: Path, layers: int, window: int) -> Path:
    vocab = len(transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_from / "tokenizer.json")))
    config = transformers.Gemma3TextConfig(
        vocab_size=vocab, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, sliding_window=window, max_position_embeddings=8192,
        query_pre_attn_scalar=64, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    transformers.Gemma3ForCausalLM(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((tokenizer_from / name).read_bytes())
    return folder


def run(folder: Path, grouped: bool, budget_mib: int, streams: int, output: int) -> None:
    original = runner_setup.kv_layout
    if not grouped:  # the one-table layout, as before the groups
        runner_setup.kv_layout = lambda windows, compiled: KVLayout.single(len(windows))  # type: ignore[assignment]
    try:
        engine = Engine(load_model(folder, torch.float32), EngineConfig(kv_budget_bytes=budget_mib * 2**20))
    finally:
        runner_setup.kv_layout = original
    prompt = list(range(100, 164))
    params = SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True)
    seqs = [engine.add_request(f"s{i}", [i + 3, *prompt], params) for i in range(streams)]
    start, steps = time.perf_counter(), 0
    while engine.has_work():
        engine.step()
        steps += 1
    elapsed = time.perf_counter() - start
    tokens = [s.output_len for s in seqs]
    layout = engine.runner.kv.layout
    print(f"{'groups' if grouped else 'one table':>9}: {layout.num_groups} group(s) of {layout.layers_per_page} "
          f"layer(s), {engine.cache.pool.num_blocks} pages of {engine.cache.block_size} tokens; output tokens "
          f"per request {tokens} ({[str(s.finish_reason.value) if s.finish_reason else '?' for s in seqs]}); "
          f"{sum(tokens) / elapsed:.1f} tok/s over {steps} steps")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--home", type=Path, default=Path(".tollway"))
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--budget-mib", type=int, default=32)
    parser.add_argument("--streams", type=int, default=2)
    parser.add_argument("--output", type=int, default=3000)
    args = parser.parse_args()
    print(f"cpu: {cpu_flags()}; {args.layers} layers (1 in 6 full), window {args.window}, "
          f"KV budget {args.budget_mib} MiB, {args.streams} streams x {args.output} tokens asked")
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_model(Path(tmp), resolve_model_folder("smollm2-135m-instruct", args.home), args.layers,
                             args.window)
        for grouped in (False, True):
            run(folder, grouped, args.budget_mib, args.streams, args.output)


if __name__ == "__main__":
    main()
