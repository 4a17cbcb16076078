"""What the engine reports: `Delta` (one step's output for one choice of a request), the
per-request bookkeeping that closes a request's last delta with its usage (`OpenRequest`), and the
prompt logprobs a request's first delta carries.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from workers.engine.request import Sequence


@dataclass
class Delta:
    """What one step produced for one choice of a request. A choice's last delta carries its
    finish_reason; the request's very last delta (all n choices finished) also carries usage."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # params.prompt_logprobs: on choice 0's first delta once the prompt is computed (Sequence.prompt_logprobs)
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None
    usage: dict[str, int] | None = None
    index: int = 0
    # beside usage, when the engine speculates: the request's drafted_tokens and accepted_tokens over
    # all its choices (for the worker's request span; not part of the wire protocol)
    speculative: dict[str, int] | None = None


@dataclass
class OpenRequest:
    """Per-request bookkeeping across its n choices."""

    parent: Sequence
    open_choices: int  # not yet finished, counting choices not yet forked
    completion_tokens: int = 0
    drafted_tokens: int = 0  # speculative decoding, over the closed choices
    accepted_tokens: int = 0

    def close_choice(self, seq: Sequence) -> dict[str, int] | None:
        """Count one finished choice; once the request's last open choice closed, its usage."""
        self.completion_tokens += seq.output_len
        self.drafted_tokens += seq.spec_drafted
        self.accepted_tokens += seq.spec_accepted
        self.open_choices -= 1 + seq.pending_forks  # choices never forked close with their parent
        seq.pending_forks = 0
        if self.open_choices:
            return None
        parent = self.parent
        return {"prompt_tokens": parent.prompt_len, "cached_tokens": parent.prompt_cached_len,
                "completion_tokens": self.completion_tokens}

    def speculative(self) -> dict[str, int]:
        """Draft tokens verified and accepted over the request's closed choices."""
        return {"drafted_tokens": self.drafted_tokens, "accepted_tokens": self.accepted_tokens}


def attach_prompt_logprobs(seq: Sequence, delta: Delta) -> None:
    """The prompt's logprobs go out once, on choice 0's first delta after its prompt is computed."""
    if seq.params.prompt_logprobs is not None and seq.index == 0:
        delta.prompt_logprobs = list(seq.prompt_logprobs)  # the delta crosses to the event loop's thread
        delta.prompt_top_logprobs = list(seq.prompt_top_logprobs)
