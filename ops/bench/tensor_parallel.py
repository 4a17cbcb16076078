"""Tensor parallel 2 vs 1 (issue 26): engine decode tok/s, offline, fp32, in one process run.

The default model (SmolLM2-135M: 9 query / 3 KV heads) does not split in 2, so the model is a
random-weight Llama of the same scale that does: 30 layers, hidden 512, 8 query / 4 KV heads of 64,
intermediate 1536, SmolLM2's 49152-token vocabulary and tokenizer files, tied embeddings (~120M
parameters), written once to a temporary folder. For each batch size B: B prompts of 32 random
tokens are prefilled in one step (not timed), then the decode steps are timed until every
sequence has `--output` tokens (stop tokens ignored). TP1 runs in this process with every core's
torch threads; TP2 splits the same cores between its two ranks (workers/parallel/launch.py).
Greedy tokens of the two runs are compared and printed.

    .venv/bin/python ops/bench/tensor_parallel.py [--home .tollway] [--output 64] [--batch 1 8]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import transformers

from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.models.assets import resolve_model_folder
from workers.models.loader import LoadedModel, load_model
from workers.parallel.launch import start_tensor_parallel
from workers.wire.sampling import SamplingParams

SHAPE: dict[str, Any] = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, max_position_embeddings=2048, rms_norm_eps=1e-5,
             tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


def write_model(folder: Path, tokenizer_source: Path) -> Path:
    config = transformers.LlamaConfig(vocab_size=49152, **SHAPE)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_source / name, folder / name)
    return folder


def decode_rate(loaded: LoadedModel, batch: int, output: int) -> tuple[float, list[list[int]]]:
    """(decode tok/s, greedy outputs) of `batch` prompts of 32 tokens."""
    gen = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(3, 40000, (32,), generator=gen).tolist() for _ in range(batch)]
    engine = Engine(loaded, EngineConfig(num_blocks=64 * batch + 64, max_batch_tokens=4096))
    params = SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True)
    seqs = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    engine.step()  # every prompt's prefill (and its first token)
    start, decoded = time.perf_counter(), sum(s.output_len for s in seqs)
    while engine.has_work():
        engine.step()
    seconds = time.perf_counter() - start
    return (sum(s.output_len for s in seqs) - decoded) / seconds, [s.output_ids for s in seqs]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--home", type=Path, default=Path(".tollway"))
    parser.add_argument("--output", type=int, default=64)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args()
    source = resolve_model_folder("smollm2-135m-instruct", args.home)
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_model(Path(tmp), source)
        single = load_model(folder, torch.float32)
        results: dict[int, list[tuple[float, list[list[int]]]]] = {}
        for b in args.batch:
            decode_rate(single, b, 4)  # warm-up
            results[b] = [decode_rate(single, b, args.output)]
        del single
        with start_tensor_parallel(folder, torch.float32, "cpu", 2) as run:
            for b in args.batch:
                decode_rate(run.loaded, b, 4)
                results[b].append(decode_rate(run.loaded, b, args.output))
    print(f"torch threads (TP1): {torch.get_num_threads()}; TP2: split between the ranks")
    print("batch | TP1 tok/s | TP2 tok/s | TP2/TP1 | same greedy tokens")
    for b, ((tp1, out1), (tp2, out2)) in results.items():
        print(f"{b:5d} | {tp1:9.1f} | {tp2:9.1f} | {tp2 / tp1:7.2f} | {out1 == out2}")


if __name__ == "__main__":
    main()
