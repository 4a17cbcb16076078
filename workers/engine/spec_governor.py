"""Whether drafting pays on this machine: speculative decoding's back-off by measured step cost.

Verifying k drafted tokens costs k more rows in the step. Where the step is bound by reading the
weights (small batches, slow matmuls: fp32 on an AVX2 CPU) those rows are nearly free; where the
matmuls are cheap and attention dominates (bf16 on AMX, where each one-token row reads the whole
context again) they cost about as much as the tokens they win, and a workload whose drafts are half
right runs slower with speculation than without (issue 23's shared-prefix chat, 0.86x on an AMX
host). Acceptance alone cannot tell these apart, so the governor measures.

It keeps, per batch-size class (the number of decoding sequences, by powers of two), a moving
average of the output tokens per second of pure decode steps with drafts ("on") and without
("off"), and drafts in the mode that is ahead. Every `PROBE_EVERY` steps it runs one step in the
other mode to keep both figures current (every `PROBE_EVERY_CLEAR` steps when one mode leads by
`CLEAR_LEAD` or more). Steps that carry a prompt are not measured (their cost is the prompt's).

Only timing-free decisions may change a seeded sampled sequence's draws: such sequences ignore the
governor (they follow the per-sequence acceptance back-off alone), so a seed still reproduces.
Greedy sequences emit the same tokens either way; unseeded sampled ones the same distribution.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from workers.engine.request import Sequence

Mode = Literal["on", "off"]
EMA = 0.25  # weight of the newest measured step
MARGIN = 0.03  # "on" stays the leader unless it is this much slower than "off" (drafting is the default)
FIRST_PROBE = 4  # measured "on" steps before the first "off" probe of a class
PROBE_EVERY = 16  # leader steps between probes
PROBE_EVERY_CLEAR = 64  # ... when the leader is ahead by CLEAR_LEAD or more
CLEAR_LEAD = 1.5


@dataclass
class SizeClass:
    """Tokens per second of one batch-size class's pure decode steps, by mode (None: not measured yet)."""

    on: float | None = None
    off: float | None = None
    streak: int = 0  # steps in the leading mode since the last probe

    def leader(self) -> Mode:
        if self.on is None or self.off is None:
            return "on"
        return "on" if self.on >= (1 - MARGIN) * self.off else "off"

    def lead(self) -> float:
        if self.on is None or self.off is None or min(self.on, self.off) <= 0:
            return 1.0
        return max(self.on, self.off) / min(self.on, self.off)

    def choose(self) -> Mode:
        if self.on is None:
            return "on"
        if self.off is None:
            return "off" if self.streak >= FIRST_PROBE else "on"
        leader = self.leader()
        interval = PROBE_EVERY_CLEAR if self.lead() >= CLEAR_LEAD else PROBE_EVERY
        if self.streak >= interval:
            return "off" if leader == "on" else "on"
        return leader

    def observe(self, mode: Mode, tokens_per_s: float, probe: bool) -> None:
        old = self.on if mode == "on" else self.off
        new = tokens_per_s if old is None else (1 - EMA) * old + EMA * tokens_per_s
        if mode == "on":
            self.on = new
        else:
            self.off = new
        self.streak = 0 if probe else self.streak + 1


class SpeculationGovernor:
    """One engine's choice, step by step, of drafting or not (see the module docstring)."""

    def __init__(self) -> None:
        self.classes: dict[int, SizeClass] = {}
        self._step: tuple[SizeClass, Mode, list[Sequence], int] | None = None  # the step being measured
        self.steps_off = 0  # steps the governor kept drafts off (metrics, tests)

    def allows(self, decoding: int) -> bool:
        """Whether sequences governed by timing draft this step (`decoding`: how many decode)."""
        allowed = not decoding or self._class(decoding).choose() == "on"
        self.steps_off += not allowed
        return allowed

    def _class(self, decoding: int) -> SizeClass:
        return self.classes.setdefault(decoding.bit_length(), SizeClass())

    def started(self, seqs: list[Sequence], drafted: bool) -> None:
        """The step's batch is scheduled: measure it if every sequence in it decodes."""
        self._step = None
        if seqs and all(s.output_len > 0 for s in seqs):
            size = self._class(len(seqs))
            self._step = (size, "on" if drafted else "off", seqs, sum(s.output_len for s in seqs))

    def finished(self, seconds: float) -> None:
        """The step ended `seconds` after drafting began: its output tokens per second."""
        if self._step is None or seconds <= 0:
            return
        size, mode, seqs, before = self._step
        self._step = None
        emitted = sum(s.output_len for s in seqs) - before
        size.observe(mode, emitted / seconds, probe=mode != size.leader())

    @staticmethod
    def governs(seq: Sequence) -> bool:
        """Whether `seq`'s drafting may follow timing: not for a seeded sampled sequence."""
        return seq.params.greedy or seq.params.seed is None
