"""Spans of a request's phases inside the engine: queue wait, prefill chunks, decode, preemptions.

The engine thread makes them with explicit start and end times (ns since the epoch) under the
parent context captured when the request arrived (the worker's `worker.generate` span), so
nothing here depends on contextvars. Only traced sequences are followed: per step the work is
O(scheduled sequences), plus a scan of the traced ones in a step that preempted; with tracing off
the engine holds no `PhaseSpans` at all. No span per token: decoding is one span per choice (per
run between preemptions) that counts its steps.

  engine.queue_wait   arrival (or preemption) → admission; tollway.after_preemption
  engine.prefill      one per chunk: tollway.prefill.new_tokens, tollway.prefill.cached_tokens
                      (prefix-cache hits at this admission, on its first chunk), position, batch size
  engine.decode       first token → finish or preemption; tollway.decode.steps, finish reason
  engine.preemption   an instant span when the scheduler took the sequence's blocks back
"""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry.context import Context
from opentelemetry.trace import Tracer

from workers.engine.request import Sequence


@dataclass(frozen=True)
class TraceParent:
    """Where a request's engine spans hang: its parent context and when it arrived."""

    context: Context
    arrival_ns: int


@dataclass
class _Followed:
    parent: Context
    queued_since_ns: int | None  # waiting for admission since then (None: admitted)
    after_preemption: bool = False
    prefilling: bool = False  # admitted; its input is not fully computed yet
    first_chunk: bool = False  # the next prefill chunk is the first since admission
    decode_since_ns: int | None = None
    decode_steps: int = 0
    preemptions: int = 0


class PhaseSpans:
    def __init__(self, tracer: Tracer) -> None:
        self._tracer = tracer
        self._followed: dict[Sequence, _Followed] = {}

    def _span(self, name: str, parent: Context, start_ns: int, end_ns: int, attributes: dict) -> None:
        span = self._tracer.start_span(name, context=parent, start_time=start_ns, attributes=attributes)
        span.end(end_time=end_ns)

    def add(self, seq: Sequence, trace: TraceParent) -> None:
        self._followed[seq] = _Followed(trace.context, trace.arrival_ns)

    def fork(self, parent: Sequence, child: Sequence, now_ns: int) -> None:
        """A forked choice (n > 1) decodes from its parent's prompt: it starts decoding now."""
        followed = self._followed.get(parent)
        if followed is not None:
            self._followed[child] = _Followed(followed.parent, None, decode_since_ns=now_ns)

    def _end_decode(self, seq: Sequence, followed: _Followed, end_ns: int, **attributes: object) -> None:
        if followed.decode_since_ns is not None:
            self._span("engine.decode", followed.parent, followed.decode_since_ns, end_ns,
                       {"tollway.decode.steps": followed.decode_steps, "tollway.choice.index": seq.index,
                        **attributes})
        followed.decode_since_ns, followed.decode_steps = None, 0

    def preempted(self, at_ns: int) -> None:
        """The step that began at `at_ns` preempted someone: find which followed sequences."""
        for seq, followed in self._followed.items():
            if seq.num_preemptions == followed.preemptions:
                continue
            followed.preemptions = seq.num_preemptions
            self._end_decode(seq, followed, at_ns, **{"tollway.decode.preempted": True})
            self._span("engine.preemption", followed.parent, at_ns, at_ns,
                       {"tollway.preemption.count": seq.num_preemptions, "tollway.output_tokens": seq.output_len,
                        "tollway.choice.index": seq.index})
            followed.queued_since_ns, followed.after_preemption, followed.prefilling = at_ns, True, False

    def step(self, seqs: list[Sequence], num_new: list[int], start_ns: int, end_ns: int) -> None:
        """After the model ran a step (computed lengths updated, nothing sampled yet)."""
        step_tokens = sum(num_new)
        for seq, n in zip(seqs, num_new, strict=True):
            followed = self._followed.get(seq)
            if followed is None:
                continue
            if followed.queued_since_ns is not None:  # admitted by this step's schedule
                self._span("engine.queue_wait", followed.parent, followed.queued_since_ns, start_ns,
                           {"tollway.priority": seq.priority.name.lower(),
                            "tollway.after_preemption": followed.after_preemption})
                followed.queued_since_ns, followed.prefilling, followed.first_chunk = None, True, True
            if followed.prefilling:
                self._span("engine.prefill", followed.parent, start_ns, end_ns, {
                    "tollway.prefill.new_tokens": n,
                    "tollway.prefill.cached_tokens": seq.cached_len if followed.first_chunk else 0,
                    "tollway.prefill.position": seq.computed_len - n,
                    "tollway.step.tokens": step_tokens, "tollway.step.sequences": len(seqs)})
                followed.first_chunk = False
                if seq.computed_len >= seq.total_len:  # its input is computed: it samples now
                    followed.prefilling, followed.decode_since_ns = False, end_ns
            else:
                followed.decode_steps += 1

    def finish(self, seq: Sequence, end_ns: int, reason: str) -> None:
        followed = self._followed.pop(seq, None)
        if followed is None:
            return
        if followed.queued_since_ns is not None:  # ended before admission (aborted, or could never fit)
            self._span("engine.queue_wait", followed.parent, followed.queued_since_ns, end_ns,
                       {"tollway.priority": seq.priority.name.lower(), "tollway.finish_reason": reason})
        self._end_decode(seq, followed, end_ns, **{"tollway.finish_reason": reason,
                                                   "tollway.output_tokens": seq.output_len})
