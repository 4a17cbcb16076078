"""Perplexity of a token sequence through the engine, in-process (`tollway eval-ppl`, its tests and
benches).

Windows (Hugging Face's sliding-window strategy): a sequence longer than `window` tokens is read in
windows of `window` tokens, each starting `stride` tokens after the one before (the last one ends
at the sequence's end and may be shorter). Every token is scored once, in the first window that
reaches it: a window scores the tokens after the previous window's end, so each scored token sees
at least `window - stride` tokens of context except those of the first window, which see all
the tokens before them. The sequence's first token is not scored (nothing predicts it): N tokens
give N - 1 scores. Perplexity = exp(mean negative log-likelihood in nats).

Each window is one engine request asking for its prompt's logprobs and no token
(`SamplingParams(max_tokens=0, prompt_logprobs=0)`; workers/engine/prompt_logprobs.py), so long
windows run as chunked prefills of `max_batch_tokens`; at most as many windows run at once as the
KV cache holds, so none is preempted for another.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from workers.engine.engine import Engine
from workers.engine.request import Sequence as EngineSequence
from workers.wire.sampling import SamplingParams

MAX_IN_FLIGHT = 8
NAMESPACE = "eval-ppl"  # the prefix-cache namespace of the windows (they never hit it: they recompute)


@dataclass(frozen=True)
class Window:
    start: int  # the window's first token
    end: int  # one past its last
    scored_from: int  # it scores tokens [scored_from, end); start < scored_from

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Perplexity:
    tokens: int  # scored: the sequence's length - 1
    nll: float  # summed negative log-likelihood of the scored tokens, nats
    windows: int

    @property
    def mean_nll(self) -> float:
        return self.nll / self.tokens

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean_nll)


def plan_windows(num_tokens: int, window: int, stride: int) -> list[Window]:
    """The windows over `num_tokens` tokens (ValueError for a sequence or sizes that cannot be scored)."""
    if num_tokens < 2:
        raise ValueError(f"perplexity needs at least 2 tokens, the text has {num_tokens}")
    if window < 2:
        raise ValueError(f"the window must hold at least 2 tokens, got {window}")
    if not 1 <= stride < window:
        raise ValueError(f"the stride must be at least 1 and below the window ({window}), got {stride}")
    windows: list[Window] = []
    start, scored_from = 0, 1
    while True:
        end = min(start + window, num_tokens)
        windows.append(Window(start, end, scored_from))
        if end == num_tokens:
            return windows
        start, scored_from = start + stride, end


def window_scores(window: Window, prompt_logprobs: Sequence[float]) -> Sequence[float]:
    """The logprobs a window scores, from its prompt logprobs (entry i: its token start + i + 1)."""
    return prompt_logprobs[window.scored_from - window.start - 1 : window.num_tokens - 1]


def in_flight_limit(engine: Engine, window: int) -> int:
    """Windows that fit the engine's KV cache together (at least 1, at most MAX_IN_FLIGHT)."""
    stats = engine.cache.stats()
    return max(1, min(MAX_IN_FLIGHT, stats.num_blocks * stats.block_size // window))


def perplexity(engine: Engine, token_ids: Sequence[int], window: int, stride: int,
               on_progress: Callable[[int], None] | None = None) -> Perplexity:
    """Score `token_ids` through `engine` in windows (plan_windows). `on_progress(tokens)` hears,
    after each engine step, how many window tokens have been computed so far (of the windows'
    total, `sum(w.num_tokens for w in plan_windows(...))`). RuntimeError if a window cannot run
    (a KV cache too small to hold one window)."""
    plan = plan_windows(len(token_ids), window, stride)
    params = SamplingParams(max_tokens=0, prompt_logprobs=0)
    limit = in_flight_limit(engine, window)
    waiting = deque(enumerate(plan))
    running: dict[str, tuple[Window, EngineSequence]] = {}
    scores: list[float] = []
    finished_tokens = 0
    while waiting or running:
        while waiting and len(running) < limit:
            index, w = waiting.popleft()
            request_id = f"{NAMESPACE}-{id(plan)}-{index}"
            running[request_id] = (w, engine.add_request(request_id, token_ids[w.start : w.end], params, NAMESPACE))
        for delta in engine.step():
            if delta.finish_reason is None:
                continue
            w, _ = running.pop(delta.request_id)
            if delta.prompt_logprobs is None or len(delta.prompt_logprobs) != w.num_tokens - 1:
                raise RuntimeError(f"the window of tokens {w.start}..{w.end} ended ({delta.finish_reason}) without "
                                   "its logprobs: the KV cache may be too small for one window")
            scores.extend(window_scores(w, delta.prompt_logprobs))
            finished_tokens += w.num_tokens
        if on_progress is not None:
            on_progress(finished_tokens + sum(min(s.computed_len, s.prompt_len) for _, s in running.values()))
    assert len(scores) == len(token_ids) - 1, "every token after the first is scored once"
    return Perplexity(len(scores), -math.fsum(scores), len(plan))
