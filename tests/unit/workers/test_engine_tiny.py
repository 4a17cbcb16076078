"""The engine on a tiny random-weight model: same tokens as plain generation in every scheduling
regime, seeds independent of batch mates, no leaked blocks after any workload (aborts included)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.workers.engine_regimes import REGIMES
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.engine.request import FinishReason, Priority
from workers.generate import SamplingParams as PlainParams
from workers.generate import generate
from workers.models.loader import LoadedModel
from workers.wire.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(tiny: LoadedModel, prompts: list[list[int]]) -> list[list[int]]:
    return [generate(tiny.model, [p], PlainParams(max_new_tokens=12))[0] for p in prompts]


def assert_no_leaks(engine: Engine) -> None:
    engine.check_integrity()
    assert engine.all_blocks_free_or_evictable()
    assert not engine.sequences and not engine.has_work()


@REGIMES
def test_greedy_matches_plain_generation(tiny, prompts, expected, config: EngineConfig) -> None:
    engine = Engine(tiny, config)
    first = engine.generate_batch(prompts, GREEDY)
    assert [s.output_ids for s in first] == expected
    assert all(s.finish_reason is FinishReason.LENGTH for s in first)
    assert_no_leaks(engine)
    again = engine.generate_batch(prompts, GREEDY)  # second round hits the prefix cache
    assert [s.output_ids for s in again] == expected
    assert all(s.cached_len > 0 for s in again)
    assert_no_leaks(engine)
    assert all(s.prompt_cached_len <= s.prompt_len for s in first + again)  # what usage bills
    if config.num_blocks == 12:
        assert sum(s.num_preemptions for s in first + again) > 0


def test_shared_prefix_is_computed_once_within_a_batch(tiny, prompts) -> None:
    engine = Engine(tiny, EngineConfig(num_blocks=200, block_size=16))
    seqs = engine.generate_batch(prompts, GREEDY)
    # the first prompt computes the 40-token system prompt; the others wait one step and hit it
    assert seqs[0].cached_len == 0
    assert all(s.cached_len == 32 for s in seqs[1:])  # whole 16-token blocks of the 40 shared tokens


def test_follow_up_turn_hits_prompt_and_output(tiny, prompts) -> None:
    engine = Engine(tiny, EngineConfig(num_blocks=200, block_size=16))
    [first] = engine.generate_batch([prompts[3]], GREEDY)
    follow_up = first.prompt_ids + first.output_ids + [5, 6, 7]
    [second] = engine.generate_batch([follow_up], GREEDY)
    assert second.cached_len == (len(first.prompt_ids) + len(first.output_ids) - 1) // 16 * 16
    assert second.cached_len > first.prompt_len  # part of the previous output came from the cache


def test_seed_reproducible_whatever_the_batch(tiny, prompts) -> None:
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = Engine(tiny, EngineConfig(num_blocks=200)).generate_batch([prompts[1]], params)[0].output_ids
    mates = [SamplingParams(max_tokens=6, temperature=1.3, seed=i, ignore_eos=True) for i in range(3)]
    crowd = Engine(tiny, EngineConfig(num_blocks=200, max_batch_tokens=24)).generate_batch(
        [prompts[0], prompts[1], prompts[2], prompts[3]], [mates[0], params, mates[1], mates[2]])
    assert crowd[1].output_ids == alone
    other_seed = Engine(tiny, EngineConfig(num_blocks=200)).generate_batch(
        [prompts[1]], SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=50, seed=99, ignore_eos=True))
    assert other_seed[0].output_ids != alone


def test_abort_mid_generation_frees_everything(tiny, prompts) -> None:
    engine = Engine(tiny, EngineConfig(num_blocks=200, max_batch_tokens=16))
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    deltas = engine.step() + engine.step()
    final = engine.abort("r1")
    assert final is not None and final.finish_reason == "abort"
    assert final.usage is not None and final.usage["prompt_tokens"] == len(prompts[1])
    assert engine.abort("r1") is None  # already gone
    while engine.has_work():
        deltas += engine.step()
    finished = {d.request_id for d in deltas if d.finish_reason}
    assert finished == {"r0", "r2", "r3"}
    assert_no_leaks(engine)


def test_stop_token_ends_the_sequence(tiny, prompts, expected) -> None:
    stop_at = expected[0][4]
    params = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(stop_at,), ignore_eos=True)
    [seq] = Engine(tiny, EngineConfig(num_blocks=200)).generate_batch([prompts[0]], params)
    assert seq.finish_reason is FinishReason.STOP
    assert seq.output_ids == expected[0][: expected[0].index(stop_at)]


def test_priority_and_aging_order_admission(tiny, prompts) -> None:
    engine = Engine(tiny, EngineConfig(num_blocks=200, max_running=1, max_wait_s=3600))
    engine.add_request("batch", prompts[0], GREEDY, priority=Priority.BATCH)
    engine.add_request("interactive", prompts[1], GREEDY, priority=Priority.INTERACTIVE)
    engine.step()
    assert [s.request_id for s in engine.scheduler.running] == ["interactive"]
    aged = Engine(tiny, EngineConfig(num_blocks=200, max_running=1, max_wait_s=0.0))
    aged.add_request("batch", prompts[0], GREEDY, priority=Priority.BATCH)
    aged.add_request("interactive", prompts[1], GREEDY, priority=Priority.INTERACTIVE)
    aged.step()  # both have waited past max_wait_s: arrival order decides
    assert [s.request_id for s in aged.scheduler.running] == ["batch"]


def test_a_prompt_too_big_for_the_cache_finishes_with_length(tiny) -> None:
    engine = Engine(tiny, EngineConfig(num_blocks=2, block_size=8))
    [seq] = engine.generate_batch([list(range(3, 40))], GREEDY)
    assert seq.finish_reason is FinishReason.LENGTH and seq.output_ids == []
    assert_no_leaks(engine)


@pytest.mark.parametrize(
    ("prompt", "message"),
    [([], "no tokens"), ([1, 10**6], "token ids"), (list(range(3, 100)) * 100, "context")],
)
def test_bad_requests_are_rejected(tiny, prompt, message: str, tmp_path: Path) -> None:
    engine = Engine(tiny, EngineConfig(num_blocks=50))
    with pytest.raises(ValueError, match=message):
        engine.add_request("x", prompt, GREEDY)
    engine.add_request("dup", [5, 6], GREEDY)
    with pytest.raises(ValueError, match="already"):
        engine.add_request("dup", [5, 6], GREEDY)


def run_deltas(engine: Engine) -> list:
    deltas = []
    while engine.has_work():
        deltas += engine.step()
    return deltas


def test_n_choices_fork_the_prompt_and_match_single_seeded_requests(tiny, prompts) -> None:
    params = SamplingParams(max_tokens=9, temperature=1.0, seed=500, n=3, ignore_eos=True)
    engine = Engine(tiny, EngineConfig(num_blocks=200))
    engine.add_request("multi", prompts[3], params)
    first = engine.step()  # prefill and fork: the three choices share the prompt's blocks
    assert sorted(d.index for d in first) == [0, 1, 2]
    choices = [s for s in engine.scheduler.running if s.request_id == "multi"]
    assert sorted(s.index for s in choices) == [0, 1, 2]
    assert choices[0].block_table.block_ids[0] == choices[1].block_table.block_ids[0]
    assert engine.pool.ref_count(choices[0].block_table.block_ids[0]) >= 3
    deltas = first + run_deltas(engine)
    outputs = {i: [t for d in deltas if d.index == i for t in d.token_ids] for i in range(3)}
    for i in range(3):  # choice i draws like a single request seeded seed + i
        single = SamplingParams(max_tokens=9, temperature=1.0, seed=500 + i, ignore_eos=True)
        [alone] = Engine(tiny, EngineConfig(num_blocks=200)).generate_batch([prompts[3]], single)
        assert choices[i].output_ids == alone.output_ids
        assert outputs[i] == alone.output_ids  # and the deltas of choice i carry exactly those
    assert len({tuple(o) for o in outputs.values()}) > 1
    with_usage = [d for d in deltas if d.usage is not None]
    assert len(with_usage) == 1 and with_usage[0] is deltas[-1]
    assert with_usage[0].usage == {"prompt_tokens": len(prompts[3]), "cached_tokens": 0, "completion_tokens": 27}
    assert_no_leaks(engine)


def test_aborting_an_n_request_closes_every_choice(tiny, prompts) -> None:
    engine = Engine(tiny, EngineConfig(num_blocks=200))
    engine.add_request("multi", prompts[0], SamplingParams(max_tokens=50, temperature=0.8, n=4, ignore_eos=True))
    engine.step()
    engine.step()
    last = engine.abort("multi")
    assert last is not None and last.usage is not None and last.usage["completion_tokens"] == 4 * 2
    assert_no_leaks(engine)


def test_prompt_continuing_into_part_of_a_cached_block_copies_it(tiny, prompts, expected) -> None:
    engine = Engine(tiny, EngineConfig(num_blocks=200, block_size=16))
    engine.generate_batch([prompts[0]], GREEDY)  # caches the 40-token system prompt and more
    [second] = engine.generate_batch([prompts[1]], GREEDY)
    assert second.cached_len == 40  # 32 in whole blocks + 8 copied from a partly matching block
    assert second.output_ids == expected[1]
    assert_no_leaks(engine)


def test_batch_sequences_sit_out_while_interactive_work_runs(tiny, prompts, expected) -> None:
    engine = Engine(tiny, EngineConfig(num_blocks=200, max_wait_s=3600))
    batch = [engine.add_request(f"b{i}", p, GREEDY, priority=Priority.BATCH) for i, p in enumerate(prompts[:2])]
    engine.step()
    engine.step()
    progress = [s.computed_len for s in batch]
    assert all(n > 0 for n in progress)
    interactive = engine.add_request("i", prompts[1], GREEDY, priority=Priority.INTERACTIVE)
    while not interactive.finished:
        engine.step()
        assert [s.computed_len for s in batch] == progress  # the batch yields every step meanwhile
    assert interactive.output_ids == expected[1]
    while engine.has_work():
        engine.step()
    assert [s.output_ids for s in batch] == expected[:2]  # then resumes, and its output is unchanged
    assert_no_leaks(engine)


def test_aged_batch_sequences_keep_running_beside_interactive_work(tiny, prompts) -> None:
    engine = Engine(tiny, EngineConfig(num_blocks=200, max_wait_s=0.0))
    batch = engine.add_request("b", prompts[0], GREEDY, priority=Priority.BATCH)
    engine.step()
    before = batch.computed_len
    engine.add_request("i", prompts[1], GREEDY, priority=Priority.INTERACTIVE)
    engine.step()
    assert batch.computed_len > before  # aged past max_wait_s: it no longer yields


def test_attention_setting_picks_the_backend_of_every_step(tiny, prompts, expected, monkeypatch) -> None:
    from kernels import reference
    from workers.settings import WorkerSettings

    monkeypatch.setenv("TOLLWAY_ATTENTION", "reference")
    calls: list[str] = []
    for name in ("decode_step", "extend_step"):
        original = getattr(reference, name)
        monkeypatch.setattr(reference, name, lambda *a, _f=original, _n=name: calls.append(_n) or _f(*a))
    engine = Engine(tiny, EngineConfig(num_blocks=200, attention=WorkerSettings().attention))
    [seq] = engine.generate_batch([prompts[2]], GREEDY)
    assert engine.runner.backend == "reference"
    assert seq.output_ids == expected[2]
    assert set(calls) == {"decode_step", "extend_step"}
