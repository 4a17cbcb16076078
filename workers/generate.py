"""Offline batched generation over a contiguous KV cache (no server, no scheduler).

Prompts are right-padded to one length and prefilled together; each row then decodes at its own
position. Rows stop at a stop token or `max_new_tokens`; the batch stops when every row has.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from workers.models.llama import LlamaForCausalLM


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
) -> list[list[int]]:
    """Completion token ids for each prompt (stop token excluded)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    batch = len(prompts)
    lengths = torch.tensor([len(p) for p in prompts])
    prompt_len = int(lengths.max())
    cache = model.allocate_cache(batch, prompt_len + params.max_new_tokens)
    generator = None
    if params.seed is not None:
        generator = torch.Generator().manual_seed(params.seed)

    input_ids = torch.zeros(batch, prompt_len, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, : len(prompt)] = torch.tensor(prompt)
    positions = torch.arange(prompt_len).expand(batch, prompt_len)
    logits = model(input_ids, positions, cache, logit_index=lengths - 1)

    stops = torch.tensor(list(stop_token_ids), dtype=torch.long)
    finished = torch.zeros(batch, dtype=torch.bool)
    outputs: list[list[int]] = [[] for _ in range(batch)]
    next_positions = lengths.clone()
    for _ in range(params.max_new_tokens):
        tokens = sample(logits, params, generator)
        finished |= torch.isin(tokens, stops)
        for row, token in enumerate(tokens.tolist()):
            if not finished[row] and len(outputs[row]) < params.max_new_tokens:
                outputs[row].append(token)
        if bool(finished.all()) or max(len(o) for o in outputs) >= params.max_new_tokens:
            break
        logits = model(tokens[:, None], next_positions[:, None], cache, logit_index=torch.zeros(batch, dtype=torch.long))
        next_positions += 1
    return outputs
