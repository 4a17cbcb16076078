"""The draft-model drafter (issue 23, `TOLLWAY_SPECULATIVE=draft`) against speculation off, engine offline.

Three engines on one loaded model: off; `draft` with the step-cost governor off (every eligible step
drafts); `draft` with the governor on (the default). The draft model is `--draft` (default: the model
itself, the only local model: its drafts are always right, so this shows what drafting costs at
best acceptance). Four short chat prompts, 48 greedy tokens each (eos ignored), at 1 and 4 streams;
the engines run one after the other in each round, `--rounds` rounds; the greedy tokens must agree.
Printed per engine: median tok/s and each round's, the acceptance rate, and (governor on) the steps
in which it kept drafts off, counted since the engine started.

    PYTHONPATH=. .venv/bin/python ops/bench/draft_model.py [--home .tollway] [--dtype auto] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.models.assets import resolve_model_folder
from workers.models.loader import load_model
from workers.models.tokenizer import tokenizer_payload
from workers.precision import resolve_dtype
from workers.wire.sampling import SamplingParams
from workers.wire.tokenizer import TextTokenizer

ASKS = ["Write a short poem about the sea.", "List three facts about the Moon.",
        "Explain what a prefix cache is in two sentences.", "What is the capital of France? Answer briefly."]
TOKENS = 48


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--home", type=Path, default=Path(os.environ.get("TOLLWAY_HOME", ".tollway")))
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--draft", default=None, help="the draft model's folder (default: the model's own)")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    folder = resolve_model_folder(args.model, args.home)
    draft = args.draft or str(folder)
    loaded = load_model(folder, resolve_dtype(args.dtype, "cpu"))
    tokenizer = TextTokenizer.from_payload(tokenizer_payload(folder))
    prompts = [tokenizer.encode_chat([{"role": "user", "content": ask}]) for ask in ASKS]
    greedy = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    modes = {"off": {}, "draft, governor off": {"speculative": "draft", "draft_model": draft, "speculative_timed": False},
             "draft, governor on": {"speculative": "draft", "draft_model": draft}}
    engines = {mode: Engine(loaded, EngineConfig(num_blocks=400, **extra)) for mode, extra in modes.items()}  # type: ignore[arg-type]
    print(f"model {folder.name} ({loaded.model.dtype}), draft {draft}, {torch.get_num_threads()} threads")
    for engine in engines.values():  # warm-up
        engine.generate_batch(prompts[:1], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    for streams in (1, 4):
        rates: dict[str, list[float]] = {mode: [] for mode in modes}
        reference = None
        for _ in range(args.rounds):
            for mode, engine in engines.items():
                start = time.perf_counter()
                tokens = [s.output_ids for s in engine.generate_batch(prompts[:streams], greedy)]
                rates[mode].append(streams * TOKENS / (time.perf_counter() - start))
                reference = reference or tokens
                assert tokens == reference, f"{mode}: greedy tokens differ"
        for mode, engine in engines.items():
            stats = engine.spec_stats.as_dict()
            kept_off = engine.spec_governor.steps_off if engine.spec_governor is not None else 0
            print(f"{streams} stream(s)  {mode:20} {statistics.median(rates[mode]):7.1f} tok/s  (rounds "
                  f"{', '.join(f'{r:.1f}' for r in rates[mode])})  acceptance {stats['acceptance_rate']:.3f}  "
                  f"steps kept off so far {kept_off}", flush=True)


if __name__ == "__main__":
    main()
