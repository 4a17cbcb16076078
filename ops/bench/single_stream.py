"""One greedy stream through the engine offline, eager against `TOLLWAY_COMPILE=decode`, per weight format.

Per round and format: a fresh engine per compile mode, one request of a `--prompt`-token prompt, its
prefill step, then `--output` decode steps timed (output tok/s after the first token). The modes alternate
within a round, so each comparison is of runs minutes apart at most. A compiled mode's first round includes
its compile (the batch-1 bucket at one context bucket): read the later rounds.

    PYTHONPATH=. .venv/bin/python ops/bench/single_stream.py --home .tollway [--formats none,int4,int4:float] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from ops.bench.quantization import cpu_flags
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.models.assets import resolve_model_folder
from workers.models.loader import load_model
from workers.precision import resolve_dtype
from workers.wire.sampling import SamplingParams


def decode_rate(engine: Engine, prompt: list[int], output: int) -> float:
    seq = engine.add_request("stream", prompt, SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True))
    engine.step()  # the prefill, which also samples the first token
    start = time.perf_counter()
    while not seq.finished:
        engine.step()
    return (seq.output_len - 1) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--home", type=Path, default=Path(os.environ.get("TOLLWAY_HOME", ".tollway")))
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--formats", default="none,int4", help="TOLLWAY_QUANTIZATION values (comma-separated), each "
                        "with :float or :int8 for TOLLWAY_QUANTIZED_ACTIVATIONS (default int8), e.g. int4:float")
    parser.add_argument("--modes", default="off,decode", help="TOLLWAY_COMPILE values (comma-separated)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=40)
    parser.add_argument("--output", type=int, default=128)
    args = parser.parse_args()
    folder = resolve_model_folder(args.model, args.home)
    dtype = resolve_dtype(args.dtype)
    print(f"single stream, {args.prompt}-token prompt, {args.output} tokens, {str(dtype).removeprefix('torch.')}, "
          f"{torch.get_num_threads()} threads; CPU flags: {cpu_flags()}", flush=True)
    prompt = [1000 + i for i in range(args.prompt)]
    for fmt in args.formats.split(","):
        quantization, _, activations = fmt.partition(":")
        loaded = load_model(folder, dtype, quantization=quantization, activations=activations or "int8")
        for round_index in range(args.rounds):
            rates = []
            for mode in args.modes.split(","):
                config = EngineConfig(max_batch_tokens=1024, kv_budget_bytes=256 * 2**20, compile=mode)
                rates.append(f"{mode} {decode_rate(Engine(loaded, config), prompt, args.output):6.1f}")
            print(f"  {fmt:10} round {round_index + 1}: " + "   ".join(rates) + " tok/s", flush=True)


if __name__ == "__main__":
    main()
