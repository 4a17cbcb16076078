"""The speculation governor (workers/engine/spec_governor.py): drafting follows the measured cost of
steps with and without drafts, probes the other mode now and then, and never touches a seeded
sampled sequence's draws."""

from __future__ import annotations

from collections import Counter

from workers.engine import spec_governor
from workers.engine.drafter import NgramDrafter
from workers.engine.request import Sequence, Status
from workers.engine.spec_governor import SpeculationGovernor
from workers.engine.speculative import propose_drafts
from workers.wire.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=64, temperature=0.0)


def decoding(n: int, params: SamplingParams = GREEDY) -> list[Sequence]:
    seqs = []
    for i in range(n):
        seq = Sequence(f"r{i}", [1, 2, 3, 1, 2, 3, 1, 2], params)
        seq.output_ids = [3]
        seq.status, seq.computed_len = Status.RUNNING, seq.total_len - 1
        seqs.append(seq)
    return seqs


def drive(governor: SpeculationGovernor, seqs: list[Sequence], seconds: dict[str, float], steps: int) -> list[str]:
    """`steps` steps of `seqs` all decoding: each emits one token a sequence, plus one more with
    drafts; a step takes seconds[mode]. The modes the governor chose, in order."""
    modes = []
    for _ in range(steps):
        mode = "on" if governor.allows(len(seqs)) else "off"
        governor.started(seqs, drafted=mode == "on")
        for seq in seqs:
            seq.output_ids += [3, 3] if mode == "on" else [3]
        governor.finished(seconds[mode])
        modes.append(mode)
    return modes


def test_drafting_that_loses_is_turned_off_and_probed_again_now_and_then() -> None:
    seqs = decoding(8)
    # With drafts: 16 tokens in 0.2 s (80/s); without: 8 in 0.08 s (100/s).
    modes = drive(SpeculationGovernor(), seqs, {"on": 0.2, "off": 0.08}, 200)
    assert modes[: spec_governor.FIRST_PROBE] == ["on"] * spec_governor.FIRST_PROBE  # drafting is the default
    later = Counter(modes[40:])
    assert later["off"] > 0.85 * 160  # off leads ...
    assert later["on"] >= 160 // (spec_governor.PROBE_EVERY + 1) - 1  # ... and on is still probed


def test_drafting_that_wins_stays_on_and_a_clear_lead_probes_less() -> None:
    close = Counter(drive(SpeculationGovernor(), decoding(2), {"on": 0.15, "off": 0.1}, 340)[20:])  # 1.33x
    clear = Counter(drive(SpeculationGovernor(), decoding(2), {"on": 0.1, "off": 0.1}, 340)[20:])  # 2x tokens
    assert close["on"] > 0.9 * 320 and clear["on"] > 0.95 * 320
    assert close["off"] >= 320 // (spec_governor.PROBE_EVERY + 1) - 1
    assert 0 < clear["off"] <= 320 // spec_governor.PROBE_EVERY_CLEAR + 1


def test_batch_sizes_are_measured_apart_and_prompt_steps_not_at_all() -> None:
    governor = SpeculationGovernor()
    drive(governor, decoding(1), {"on": 0.01, "off": 0.01}, 40)  # one stream: drafting wins
    drive(governor, decoding(8), {"on": 0.5, "off": 0.05}, 40)  # eight: it loses
    assert governor.classes[(1).bit_length()].leader() == "on"
    assert governor.classes[(8).bit_length()].leader() == "off"
    prefilling = decoding(8)
    prefilling[0].output_ids = []  # still computing its prompt: the step's cost is the prompt's
    before = vars(governor.classes[(8).bit_length()]).copy()
    governor.started(prefilling, drafted=False)
    governor.finished(5.0)
    assert vars(governor.classes[(8).bit_length()]) == before


def test_a_seeded_sampled_sequence_drafts_whatever_the_timing_says() -> None:
    governor = SpeculationGovernor()
    drive(governor, decoding(3), {"on": 1.0, "off": 0.01}, 30)  # drafting loses badly at 3 sequences
    greedy, seeded, unseeded = decoding(1), decoding(1, SamplingParams(max_tokens=64, temperature=0.8, seed=7)), \
        decoding(1, SamplingParams(max_tokens=64, temperature=0.8))
    running = greedy + seeded + unseeded
    governor.classes[(3).bit_length()].streak = 0  # not a probe step
    propose_drafts(running, NgramDrafter(3), k=4, max_batch=16, max_context=2048, governor=governor)
    assert greedy[0].draft_ids == [] and unseeded[0].draft_ids == []
    assert seeded[0].draft_ids == [1, 2, 3]  # the prompt repeats: ngram proposes what followed its last match
