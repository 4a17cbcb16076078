"""Offline batched generation over paged KV (no server, no scheduler).

All prompts are prefilled in one flat step, then the unfinished ones decode together; a row leaves
the batch at a stop token or after `max_new_tokens`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cache.block_pool import BlockPool
from cache.block_table import BlockTable
from workers.models.llama import LlamaForCausalLM
from workers.paged_step import run_step


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        if not self.temperature >= 0.0:  # also rejects NaN
            raise ValueError("temperature must be >= 0")


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """Next token per row from fp32 logits [B, V]: argmax when greedy, else softmax(logits / T)."""
    if params.temperature == 0.0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / params.temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def generate(
    model: LlamaForCausalLM,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    stop_token_ids: Sequence[int] = (),
    block_size: int = 16,
) -> list[list[int]]:
    """Completion token ids for each prompt (stop token excluded)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    num_blocks = sum(-(-(len(p) + params.max_new_tokens) // block_size) for p in prompts)
    kv = model.allocate_kv(num_blocks, block_size)
    pool = BlockPool(num_blocks, block_size)
    tables = [BlockTable(pool) for _ in prompts]
    generator = None
    if params.seed is not None:
        generator = torch.Generator(device=model.device).manual_seed(params.seed)

    logits = run_step(model, kv, tables, prompts)
    stops = set(stop_token_ids)
    outputs: list[list[int]] = [[] for _ in prompts]
    active = list(range(len(prompts)))  # rows still generating, in the order of `logits`
    while active:
        tokens = sample(logits, params, generator).tolist()
        still = []
        for row, token in zip(active, tokens, strict=True):
            if token in stops:
                continue
            outputs[row].append(token)
            if len(outputs[row]) < params.max_new_tokens:
                still.append(row)
        active = still
        if active:
            logits = run_step(model, kv, [tables[r] for r in active], [[outputs[r][-1]] for r in active])
    return outputs
