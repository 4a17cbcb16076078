"""Grammar-constrained decoding's cost: a shared-prefix chat workload with a JSON schema on every
request against the same workload unconstrained, in one process, alternately, best of N.

Workload: G groups x P chat prompts (each group shares a system prompt of ~S tokens; each prompt a
distinct question), greedy, O output tokens at most (the free run ignores stop tokens, so it writes
exactly O; a constrained one stops when its JSON is complete, so tok/s counts the tokens actually
written). Each run uses its own prefix-cache namespace: both start cold and share within groups.
Also: the mask time per token at batch 32 (xgrammar `fill_next_token_bitmask` for 32 matchers
mid-document, plus `apply_token_bitmask_inplace` on [32, vocab] logits), and the engine's own
fill seconds per constrained row during the runs.

    .venv/bin/python ops/bench/grammar_overhead.py [--groups 4 --per-group 8 --system 340 --output 32 --repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.models.assets import resolve_model_folder
from workers.models.loader import LoadedModel, load_model
from workers.precision import resolve_dtype
from workers.wire.grammar import GrammarSpec
from workers.wire.sampling import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "maxLength": 120},
        "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
        "category": {"enum": ["tools", "garden", "paint", "other"]},
        "items": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 4},
    },
    "required": ["answer", "confidence", "category", "items"],
    "additionalProperties": False,
}
TOPICS = ["hammers", "nails", "paint rollers", "garden hoses", "ladders", "drills", "screws", "gloves"]


def workload(loaded: LoadedModel, groups: int, per_group: int, system_tokens: int) -> list[list[int]]:
    codec = loaded.tokenizer
    prompts = []
    for g in range(groups):
        sentence = f"You are assistant number {g} of a hardware store. Answer in JSON with the fields asked. "
        repeats = max(1, system_tokens // len(codec.encode(sentence, add_special_tokens=False)))
        system = sentence * repeats
        for p in range(per_group):
            question = f"Question {p}: do you sell {TOPICS[p % len(TOPICS)]}, and which brands?"
            text = (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
                    "<|im_start|>assistant\n")
            prompts.append(codec.encode(text, add_special_tokens=False))
    return prompts


def run(engine: Engine, prompts: list[list[int]], params: SamplingParams, namespace: str) -> tuple[float, int]:
    """(seconds, output tokens) of the whole workload submitted at once."""
    start = time.perf_counter()
    seqs = engine.generate_batch(prompts, params, namespace)
    seconds = time.perf_counter() - start
    return seconds, sum(s.output_len for s in seqs)


def mask_time_at_batch(engine: Engine, batch: int, prefix_ids: list[int], repeats: int = 50) -> tuple[float, float]:
    """(fill µs per row, apply µs per row) for `batch` matchers advanced by `prefix_ids`."""
    import xgrammar as xgr

    spec = GrammarSpec.json_schema(SCHEMA)
    matchers = [engine.grammars.rebuild(spec, prefix_ids) for _ in range(batch)]
    vocab = engine.loaded.model.config.vocab_size
    bitmask = xgr.allocate_token_bitmask(batch, vocab)
    logits = torch.randn(batch, vocab)
    fill = apply = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        for row, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(bitmask, row)
        t1 = time.perf_counter()
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        t2 = time.perf_counter()
        fill, apply = fill + t1 - t0, apply + t2 - t1
    return fill / repeats / batch * 1e6, apply / repeats / batch * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--home", type=Path, default=Path(os.environ.get("TOLLWAY_HOME", ".tollway")))
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--per-group", type=int, default=8)
    parser.add_argument("--system", type=int, default=340)
    parser.add_argument("--output", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    loaded = load_model(resolve_model_folder(args.model, args.home), resolve_dtype(args.dtype, "cpu"))
    engine = Engine(loaded, EngineConfig())
    prompts = workload(loaded, args.groups, args.per_group, args.system)
    spec = GrammarSpec.json_schema(SCHEMA)
    free = SamplingParams(max_tokens=args.output, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=args.output, temperature=0.0, grammar=spec)
    engine.generate_batch(prompts[:2], [free, constrained], "warmup")  # loads xgrammar, compiles the schema
    print(f"threads={torch.get_num_threads()}  dtype={str(loaded.model.dtype).removeprefix('torch.')}  "
          f"{args.groups} groups x {args.per_group} prompts, ~{sum(map(len, prompts)) // len(prompts)} prompt tokens, "
          f"{args.output} output tokens at most, greedy, best of {args.repeats}")
    best: dict[str, float] = {}
    fill_s = rows = 0.0
    for rep in range(args.repeats):
        for name, params in (("free", free), ("json_schema", constrained)):
            before_s, before_rows = engine.masks.fill_s, engine.masks.rows_filled
            seconds, tokens = run(engine, prompts, params, f"{name}-{rep}")
            if name == "json_schema":
                fill_s += engine.masks.fill_s - before_s
                rows += engine.masks.rows_filled - before_rows
            rate = tokens / seconds
            best[name] = max(best.get(name, 0.0), rate)
            print(f"  run {rep} {name:12} {tokens:5d} tokens {seconds:7.2f} s {rate:8.1f} out tok/s", flush=True)
    ratio = best["json_schema"] / best["free"]
    print(f"\nbest output tok/s: free {best['free']:.1f}, json_schema {best['json_schema']:.1f}, "
          f"ratio {ratio:.3f}x (goal >= 0.9x: {'met' if ratio >= 0.9 else 'NOT met'})")
    print(f"engine mask fill during the runs: {fill_s / max(rows, 1) * 1e6:.1f} µs per constrained row "
          f"(on the helper thread, beside the forward pass)")
    prefix = loaded.tokenizer.encode('{"answer": "We sell', add_special_tokens=False)
    fill_us, apply_us = mask_time_at_batch(engine, 32, prefix)
    print(f"mask time per token at batch 32: fill {fill_us:.1f} µs + apply {apply_us:.1f} µs = "
          f"{fill_us + apply_us:.1f} µs per row ({(fill_us + apply_us) * 32 / 1e3:.2f} ms per step)")
    print(json.dumps({"free_tok_s": round(best["free"], 1), "json_schema_tok_s": round(best["json_schema"], 1),
                      "ratio": round(ratio, 3), "fill_us_per_row_b32": round(fill_us, 1),
                      "apply_us_per_row_b32": round(apply_us, 1)}))


if __name__ == "__main__":
    main()
