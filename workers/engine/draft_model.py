"""The draft-model drafter (`TOLLWAY_SPECULATIVE=draft`): a second, smaller model sharing the target's
tokenizer (the same model in a smaller size, or any local folder of that family) proposes each
sequence's next tokens by greedy decoding; the engine verifies them (workers/engine/speculative.py),
so the draft's quality only decides the speed, never the output.

The draft runs on transformers (`AutoModelForCausalLM`) in the target's dtype on the target's device.
Each sequence keeps a transformers `DynamicCache` and the token ids whose K/V it holds (`consumed`).
A proposal feeds only what changed since the sequence's last one: the cache is cropped to the
longest common prefix of `consumed` and the sequence's tokens (so rejected drafts, and anything a
preemption changed, fall away by themselves), the rest goes in in one forward, then k - 1 more
forwards draw the draft. Invariant: the cache holds exactly the K/V of `consumed`.

A state lives in a `WeakKeyDictionary` keyed by the `Sequence` (hashable by identity) and is dropped
when its sequence is garbage, or, finished, when the next sequence's state is made.
Sequences draft one after another: batching the draft across sequences is left for later.
"""

from __future__ import annotations

import inspect
import json
import weakref
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from workers.engine.request import Sequence


class DraftModelError(ValueError):
    """A draft model this engine cannot use (not found, or not sharing the target's tokenizer)."""


@dataclass(frozen=True)
class DraftTarget:
    """What the draft must agree with: the target model's vocabulary, dtype and device."""

    vocab_size: int
    dtype: torch.dtype
    device: torch.device
    tokenizer_file: Path | None = None  # the target's tokenizer.json, when it has one


@dataclass
class _State:
    cache: Any  # transformers.DynamicCache
    consumed: list[int] = field(default_factory=list)


def common_prefix(a: Seq[int], b: Seq[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def check_draft_folder(folder: Path, target: DraftTarget) -> None:
    """DraftModelError unless the draft's vocabulary is the target's: the same size and, where both
    folders have a tokenizer.json, the same token -> id mapping."""
    try:
        vocab = json.loads((folder / "config.json").read_text()).get("vocab_size")
    except (OSError, json.JSONDecodeError, AttributeError) as exc:
        raise DraftModelError(f"draft model {folder}: unreadable config.json ({exc})") from exc
    if vocab != target.vocab_size:
        raise DraftModelError(f"draft model {folder} has a vocabulary of {vocab} tokens, the model "
                              f"{target.vocab_size}: a draft model must share the model's tokenizer")
    theirs = folder / "tokenizer.json"
    if target.tokenizer_file is not None and target.tokenizer_file.is_file() and theirs.is_file():
        from tokenizers import Tokenizer

        if (Tokenizer.from_file(str(theirs)).get_vocab(with_added_tokens=True)
                != Tokenizer.from_file(str(target.tokenizer_file)).get_vocab(with_added_tokens=True)):
            raise DraftModelError(f"draft model {folder} has a different tokenizer from the model's: "
                                  "a draft model must share the model's tokenizer")


def cache_keyword(model: Any) -> str:
    """The keyword a transformers causal LM's `forward` takes its KV cache by: `cache` where it has one
    (transformers 5.24 deprecates `past_key_values` for it, to be removed in 5.40), else `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class ModelDrafter:
    def __init__(self, model: Any, max_positions: int) -> None:
        self.model = model  # a transformers causal LM in eval mode
        self.cache_keyword = cache_keyword(model)
        self.max_positions = max_positions
        self.states: weakref.WeakKeyDictionary[Sequence, _State] = weakref.WeakKeyDictionary()

    @classmethod
    def load(cls, folder: Path, target: DraftTarget) -> ModelDrafter:
        """The draft model of `folder`, checked against `target` (DraftModelError), in its dtype and on its device."""
        check_draft_folder(folder, target)
        from transformers import AutoModelForCausalLM  # only where a draft model is asked for

        try:
            model: Any = AutoModelForCausalLM.from_pretrained(folder, dtype=target.dtype)
        except (OSError, ValueError, KeyError) as exc:
            raise DraftModelError(f"draft model {folder} does not load: {exc}") from exc
        model = model.to(target.device).eval().requires_grad_(False)
        return cls(model, int(getattr(model.config, "max_position_embeddings", 0) or 2**31))

    def propose(self, token_ids: Seq[int], k: int, key: Sequence | None = None) -> list[int]:
        """The draft's greedy continuation of `token_ids`, k tokens (fewer near its context's end).
        With `key` (the sequence), its cache is reused across calls; without, a fresh one serves this call."""
        k = min(k, self.max_positions - len(token_ids))
        if k <= 0 or not token_ids:
            return []
        from transformers import DynamicCache

        state = self.states.get(key) if key is not None else None
        if state is None:
            state = _State(DynamicCache())
            if key is not None:
                self._drop_finished()  # once per new sequence, not on every proposal
                self.states[key] = state
        tokens = list(token_ids)
        # keep the K/V of the common prefix, but always feed at least the newest token (its logits start the draft)
        keep = min(common_prefix(state.consumed, tokens), len(tokens) - 1)
        if keep < len(state.consumed):
            state.cache.crop(keep - len(state.consumed))  # negative: tokens to remove
            if state.cache.get_seq_length() != keep:  # a cache that cannot shrink so (a sliding window): start over
                state.cache, keep = DynamicCache(), 0
        draft = self._decode(state.cache, tokens[keep:], k)
        state.consumed = tokens + draft[:-1]  # the last drafted token was never fed
        return draft

    @torch.inference_mode()
    def _decode(self, cache: Any, fresh: list[int], k: int) -> list[int]:
        device = self.model.device
        draft: list[int] = []
        feed = fresh
        while True:
            ids = torch.tensor([feed], dtype=torch.long, device=device)
            logits = self.model(input_ids=ids, **{self.cache_keyword: cache}, use_cache=True, logits_to_keep=1).logits
            draft.append(int(logits[0, -1].argmax()))
            if len(draft) == k:
                return draft
            feed = draft[-1:]

    def _drop_finished(self) -> None:
        for seq in [s for s in self.states if s.finished]:
            del self.states[seq]
