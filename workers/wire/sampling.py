"""Sampling parameters of one request, validated at construction (ValueError = the caller's 400)."""

from __future__ import annotations

from dataclasses import dataclass

from workers.wire.grammar import GrammarSpec


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256  # 0 = prefill only (the prompt's logprobs, or warming the prefix cache): finish "length"
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # >1 discourages every token seen in prompt or output
    frequency_penalty: float = 0.0  # OpenAI: minus penalty * count in the output so far
    presence_penalty: float = 0.0  # OpenAI: minus penalty once a token appeared in the output
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings; the matched string is not emitted
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off; k = the chosen token's logprob and the top k
    # None = off; k = each prompt token's logprob (after the first) and the top k at its position
    # (workers/engine/prompt_logprobs.py); the request then computes its whole prompt, prefix cache or not
    prompt_logprobs: int | None = None
    n: int = 1
    grammar: GrammarSpec | None = None  # what the output must match (the body's `grammar`, not `sampling`)

    def __post_init__(self) -> None:
        for name in ("max_tokens", "top_k", "n"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int):
                raise ValueError(f"{name} must be an integer")
        for name in ("seed", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{name} must be an integer")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be integers")
        checks = [
            (self.max_tokens >= 0, "max_tokens must be at least 0 (0 = prefill only)"),
            (0.0 <= self.temperature <= 100.0, "temperature must be in [0, 100]"),
            (self.top_k >= 0, "top_k must be >= 0 (0 = off)"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            (0.0 < self.repetition_penalty <= 10.0, "repetition_penalty must be in (0, 10]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs must be in [0, 20]"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "prompt_logprobs must be in [0, 20]"),
            (1 <= self.n <= 16, "n must be in [1, 16]"),
            (self.max_tokens >= 1 or self.n == 1, "max_tokens 0 (prefill only) takes n = 1"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty"),
            (len(self.stop) <= 8, "at most 8 stop strings"),
        ]
        for ok, message in checks:  # NaN fails every comparison, so it is rejected too
            if not ok:
                raise ValueError(message)

    @property
    def constrained(self) -> bool:
        return self.grammar is not None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def truncates(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0
