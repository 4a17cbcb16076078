"""Overlapped steps: the host schedules and launches step N+1 while the device still runs step N.

A plain step ends by reading its sampled tokens on the host (`.tolist()`), so on a GPU the device
idles while the host schedules the next step, builds its metadata and launches it, and the host
idles while the device runs. Here (SGLang's overlap scheduler is the idea) a step instead:
1. schedules the next batch at once: each sequence that sampled in the step before holds a
   placeholder (request.PENDING_TOKEN) as its newest token, so its lengths, blocks and positions
   are already right, only the token's value is unknown;
2. runs the model with those newest tokens read on the device from the step before's samples
   (runner.py `PendingTokens`);
3. only then reads the step before's tokens (already there, or nearly: the device ran that step
   while the host did 1 and 2) and emits them as a plain step does: stops, text, deltas; a choice
   that stops there has run one row of this step for nothing, its row dropped;
4. updates the scheduler for this step (after 3: blocks committed to the prefix tree read real ids),
   draws this step's tokens on the device (sampler.py `draw_sample`), starts their copy to the host
   (pinned memory, one event) and appends this step's placeholders.

A placeholder is the last of its sequence's ids and is written over before anything reads ids as
text, commits them to the prefix tree or bills them. Its block slot is filled by the step that
reads it on the device. A choice whose pending token is its last (max_tokens or the context
reached) sits out until it is read (`Sequence.last_token_pending`): it always finishes there.

The step's draw comes after 3, so what it reads on the host is current: grammar masks from matchers
that took the token before, penalties over the output so far; its logprobs travel to the host with
its tokens; choices forked in the step (n > 1) draw from their parent's row as in a plain step. Not run
ahead (the engine reads the step in flight and steps plainly while any running or waiting request is
one): prompt logprobs, prompt-only requests and speculative drafting. An abort reads the step in flight too (`Engine.abort`).

On by default on CUDA (`EngineConfig.overlap`, TOLLWAY_OVERLAP); on a CPU the same cores run the
host's work and the model, so nothing overlaps: `on` there is for tests (the tokens must equal the
plain engine's).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kernels.metadata import to_device
from workers.engine.config import OverlapMode
from workers.engine.deltas import Delta
from workers.engine.request import PENDING_TOKEN, Sequence
from workers.engine.sampler import DeviceSample, draw_sample

if TYPE_CHECKING:
    from workers.engine.engine import Engine


def enabled(mode: OverlapMode, device_type: str) -> bool:
    """auto: on CUDA only (where the device runs while the host works)."""
    return mode == "on" or (mode == "auto" and device_type == "cuda")


def runs_ahead(seq: Sequence) -> bool:
    """Whether a sequence can run ahead: not a prompt-only request, no prompt logprobs to compute (both
    are read on the host inside their step)."""
    p = seq.params
    return p.prompt_logprobs is None and p.max_tokens > 0


class HostCopy:
    """Device tensors on their way to the host: on CUDA copies into pinned memory behind one event,
    read (`wait`) once the device got there; elsewhere the tensors themselves."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._event: torch.cuda.Event | None = None
        self._host = tensors
        if tensors and tensors[0].device.type == "cuda":
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for host, tensor in zip(self._host, tensors, strict=True):
                host.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def wait(self) -> list[torch.Tensor]:
        if self._event is not None:
            self._event.synchronize()
        return self._host


@dataclass
class InFlight:
    """A launched step whose draw the host has not read: the sampling sequences (one row each), where
    each one's placeholder sits in its output ids, the draw on the device and its copy to the host."""

    sampling: list[Sequence]
    rows: dict[Sequence, int]
    placeholders: list[int]  # row -> index of the row's PENDING_TOKEN in its sequence's output_ids
    drawn: DeviceSample
    host: HostCopy

    @property
    def tokens(self) -> torch.Tensor:
        return self.drawn.token_ids


def launch(sampling: list[Sequence], drawn: DeviceSample, max_context: int) -> InFlight:
    """Start the draw's copy to the host and give each sampling sequence its placeholder."""
    host = HostCopy(drawn.tensors())
    placeholders = []
    for seq in sampling:
        placeholders.append(seq.output_len)
        seq.output_ids.append(PENDING_TOKEN)
        if seq.output_len >= seq.params.max_tokens or seq.total_len >= max_context:
            seq.last_token_pending = True
    return InFlight(sampling, {seq: row for row, seq in enumerate(sampling)}, placeholders, drawn, host)


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
    logits = engine.runner.run(batch, engine.in_flight).logits if batch.seqs else None
    deltas += settle(engine)
    deltas += [engine.close_choice(s) for s in finished]
    if logits is None:
        return deltas
    update = scheduler.update(batch)
    if phases is not None:
        phases.step(batch.seqs, batch.num_new, start_ns, time.time_ns())
    sampling, logits = engine.start_forks(update, logits)  # n > 1: each choice forked now draws from its parent's row
    rows = [row for row, seq in enumerate(sampling) if not seq.finished]  # not stopped on the token before
    if rows:
        live = [sampling[row] for row in rows]
        if len(live) < logits.shape[0]:
            logits = logits[to_device(rows, torch.long, logits.device)]
        constrain = None
        if any(seq.matcher is not None for seq in live):  # the matchers took the token before: masks now
            def constrain(work: torch.Tensor) -> None:
                engine.masks.constrain(work, live, None, 0)
        engine.in_flight = launch(live, draw_sample(logits, live, constrain), engine.max_context)
    return deltas


def settle(engine: Engine, dropping: str | None = None) -> list[Delta]:
    """Read the step in flight (if any) and emit its tokens as a plain step does. The choices of request
    `dropping` (being aborted) lose their pending token instead: never streamed, never billed."""
    flight, engine.in_flight = engine.in_flight, None
    if flight is None:
        return []
    result = flight.drawn.read(flight.host.wait())
    now = time.monotonic()
    deltas = []
    for row, seq in enumerate(flight.sampling):
        at = flight.placeholders[row]
        assert seq.output_ids[at:] == [PENDING_TOKEN], "a placeholder is always its sequence's last id"
        del seq.output_ids[at:]
        if seq.finished:  # the scheduler ended it since (it could never fit): keep the token
            seq.output_ids.append(result.token_ids[row])
            deltas.append(Delta(seq.request_id, [result.token_ids[row]], index=seq.index))
        elif seq.request_id != dropping:
            deltas.append(engine.advance(seq, row, result, now))
    return deltas
