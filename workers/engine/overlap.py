"""Overlapped steps: the host schedules and launches step N+1 while the device still runs step N.

A plain step ends by reading its sampled tokens on the host (`.tolist()`), so on a GPU the device
idles while the host schedules the next step, builds its metadata and launches it, and the host
idles while the device runs. Here (SGLang's overlap scheduler is the idea) a step instead:
1. schedules the next batch at once: each sequence that sampled in the step before holds a
   placeholder (request.PENDING_TOKEN) as its newest token, so its lengths, blocks and positions
   are already right, only the token's value is unknown;
2. runs the model with those newest tokens read on the device from the step before's samples
   (runner.py `PendingTokens`), draws this step's tokens on the device (sampler.py `draw`) and
   starts copying them to the host, then appends this step's placeholders;
3. only then reads the step before's tokens (already there, or nearly: the device ran that step
   while the host did 1 and 2) and emits them as a plain step does: stops, text, deltas; a choice
   that stops there has run one row of this step for nothing, its result dropped;
4. updates the scheduler for this step (after 3: blocks committed to the prefix tree read real ids),
   and only then appends this step's placeholders.

A placeholder is the last of its sequence's ids and is written over before anything reads ids as
text, commits them to the prefix tree or bills them. Its block slot is filled by the step that
reads it on the device. A choice whose pending token is its last (max_tokens or the context
reached) sits out until it is read (`Sequence.last_token_pending`): it always finishes there.

Only sequences that need nothing from the host between steps run ahead (`runs_ahead`): no grammar,
no logprobs, no penalties (they read the output ids), no choices to fork (n > 1), no prompt-only
request, no speculative drafting. While any running or waiting request needs one, the engine reads
the step in flight and steps plainly. An abort reads it too (`Engine.abort`).

On by default on CUDA (`EngineConfig.overlap`, TOLLWAY_OVERLAP); on a CPU the same cores run the
host's work and the model, so nothing overlaps: `on` there is for tests (the tokens must equal the
plain engine's).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from workers.engine.config import OverlapMode
from workers.engine.deltas import Delta, attach_prompt_logprobs
from workers.engine.request import PENDING_TOKEN, Sequence
from workers.engine.sampler import draw

if TYPE_CHECKING:
    from workers.engine.engine import Engine


def enabled(mode: OverlapMode, device_type: str) -> bool:
    """auto: on CUDA only (where the device runs while the host works)."""
    return mode == "on" or (mode == "auto" and device_type == "cuda")


def runs_ahead(seq: Sequence) -> bool:
    """Whether a sequence needs nothing from the host between two steps."""
    p = seq.params
    return (seq.matcher is None and p.logprobs is None and p.prompt_logprobs is None and not p.penalized
            and seq.pending_forks == 0 and p.max_tokens > 0)


class HostTokens:
    """A device tensor of token ids on its way to the host: on CUDA a copy into pinned memory behind
    an event, read (`wait`) once the device got there; elsewhere the tensor itself."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self._event: torch.cuda.Event | None = None
        if tokens.device.type == "cuda":
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tokens

    def wait(self) -> list[int]:
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()


@dataclass
class InFlight:
    """A launched step whose sampled tokens the host has not read: the sampling sequences (one row
    each), where each one's placeholder sits in its output ids, and the tokens on the device."""

    sampling: list[Sequence]
    rows: dict[Sequence, int]
    placeholders: list[int]  # row -> index of the row's PENDING_TOKEN in its sequence's output_ids
    tokens: torch.Tensor
    host: HostTokens


def launch(sampling: list[Sequence], tokens: torch.Tensor, host: HostTokens, max_context: int) -> InFlight:
    """Give each sampling sequence still running its placeholder for `tokens` (on their way in `host`)."""
    placeholders = []
    for seq in sampling:
        placeholders.append(seq.output_len)
        if seq.finished:  # it stopped on the step before's token: its row here is dropped when read
            continue
        seq.output_ids.append(PENDING_TOKEN)
        if seq.output_len >= seq.params.max_tokens or seq.total_len >= max_context:
            seq.last_token_pending = True
    return InFlight(sampling, {seq: row for row, seq in enumerate(sampling)}, placeholders, tokens, host)


def step(engine: Engine) -> list[Delta]:
    """One overlapped step (the module's 1-4); the step before's deltas are what it returns."""
    deltas = engine.take_carried()
    scheduler = engine.scheduler
    if engine.drafter is not None or not all(runs_ahead(s) for s in scheduler.running + scheduler.waiting):
        return deltas + settle(engine) + engine.plain_step()
    phases = engine.phases
    if phases is not None:
        start_ns, preemptions = time.time_ns(), scheduler.preemptions
    batch = scheduler.schedule()
    if phases is not None and scheduler.preemptions != preemptions:
        phases.preempted(start_ns)
    finished = scheduler.take_finished()  # could never fit: closed once the step before is read
    sampling, tokens = batch.sampling, None
    if batch.seqs:
        logits = engine.runner.run(batch, engine.in_flight).logits
        if sampling:
            tokens = draw(logits, sampling)
            host = HostTokens(tokens)  # queued behind the step: the host goes on at once
    deltas += settle(engine)
    deltas += [engine.close_choice(s) for s in finished]
    if batch.seqs:
        scheduler.update(batch)
        if phases is not None:
            phases.step(batch.seqs, batch.num_new, start_ns, time.time_ns())
    if tokens is not None:
        engine.in_flight = launch(sampling, tokens, host, engine.max_context)
    return deltas


def settle(engine: Engine, dropping: str | None = None) -> list[Delta]:
    """Read the step in flight (if any) and emit its tokens as a plain step does. The choices of request
    `dropping` (being aborted) lose their pending token instead: never streamed, never billed."""
    flight, engine.in_flight = engine.in_flight, None
    if flight is None:
        return []
    token_ids = flight.host.wait()
    now = time.monotonic()
    deltas = []
    for row, seq in enumerate(flight.sampling):
        token, at = token_ids[row], flight.placeholders[row]
        if at >= seq.output_len or seq.output_ids[at] != PENDING_TOKEN:
            continue  # it stopped on its token before: this row ran for nothing
        del seq.output_ids[at:]  # the placeholder is its last id
        if seq.finished:  # the scheduler ended it since (it could never fit): keep the token
            seq.output_ids.append(token)
            deltas.append(Delta(seq.request_id, [token], index=seq.index))
        elif seq.request_id != dropping:
            delta = Delta(seq.request_id, [token], index=seq.index)
            if not seq.output_ids:
                attach_prompt_logprobs(seq, delta)
            deltas.append(engine.emit(seq, token, delta, now))
    return deltas
