"""Overlapped steps (workers/engine/overlap.py) on the tiny model, on the CPU (`overlap="on"`): the
same tokens, text, finish reasons and usage as plain steps in every regime, steps that really run
ahead (a placeholder in flight, the next step reading it on the device), plain steps while a request
needs the host between steps, and no block or placeholder left behind by stops, aborts or limits."""

from __future__ import annotations

from dataclasses import replace

from tests.unit.workers.engine_regimes import REGIMES
from workers.engine.config import EngineConfig
from workers.engine.deltas import Delta
from workers.engine.engine import Engine
from workers.engine.overlap import enabled
from workers.engine.request import PENDING_TOKEN, FinishReason
from workers.engine.runner import ModelRunner
from workers.wire.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def assert_clean(engine: Engine) -> None:
    engine.check_integrity()
    assert engine.all_blocks_free_or_evictable()
    assert not engine.sequences and not engine.has_work() and engine.in_flight is None


def by_request(deltas: list[Delta]) -> dict[str, tuple[list[int], str, str | None, dict | None]]:
    """Each request's joined tokens and text, its finish reason and usage."""
    out: dict[str, tuple[list[int], str, str | None, dict | None]] = {}
    for d in deltas:
        tokens, text, reason, usage = out.get(d.request_id, ([], "", None, None))
        out[d.request_id] = (tokens + d.token_ids, text + d.text, d.finish_reason or reason, d.usage or usage)
    return out


def run(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> list[Delta]:
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, params)
    deltas = []
    while engine.has_work():
        deltas += engine.step()
    return deltas


@REGIMES
def test_overlapped_steps_match_plain_steps(tiny, prompts, config: EngineConfig) -> None:
    plain = Engine(tiny, replace(config, overlap="off"))
    ahead = Engine(tiny, replace(config, overlap="on"))
    assert not plain.overlap and ahead.overlap
    for _ in range(2):  # the second round hits the prefix cache
        expected = [s.output_ids for s in plain.generate_batch(prompts, GREEDY)]
        seqs = ahead.generate_batch(prompts, GREEDY)
        assert [s.output_ids for s in seqs] == expected
        assert all(s.finish_reason is FinishReason.LENGTH for s in seqs)
        assert_clean(ahead)
    if config.num_blocks == 12:
        assert ahead.scheduler.preemptions > 0


def test_stops_limits_text_and_usage_match_plain_steps(tiny, prompts) -> None:
    reference = Engine(tiny, EngineConfig(num_blocks=200)).generate_batch([prompts[0]], GREEDY)[0].output_ids
    requests = [
        (prompts[0], SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(reference[4],), ignore_eos=True)),
        (prompts[1], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)),
        (prompts[2], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)),
        (prompts[3], SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=50, seed=7, ignore_eos=True)),
        (prompts[1][:20], SamplingParams(max_tokens=8, temperature=1.2, seed=3)),  # EOS may stop it
        (prompts[2], GREEDY),
    ]
    config = EngineConfig(num_blocks=200, max_batch_tokens=24)
    plain = by_request(run(Engine(tiny, replace(config, overlap="off")), requests))
    ahead_engine = Engine(tiny, replace(config, overlap="on"))
    ahead = by_request(run(ahead_engine, requests))
    assert ahead == plain
    assert plain["r0"][2] == "stop" and plain["r0"][0] == reference[: reference.index(reference[4])]
    assert plain["r1"][2] == "length" and len(plain["r1"][0]) == 3
    assert_clean(ahead_engine)


def test_the_context_limit_ends_choices_as_plain_steps_do(tiny, prompts) -> None:
    config = EngineConfig(num_blocks=200, max_context=50)
    requests = [(p, GREEDY) for p in prompts[:3]]  # 45, 57 (too long: refused), 41 tokens
    requests = [r for r in requests if len(r[0]) < 50]
    plain = by_request(run(Engine(tiny, replace(config, overlap="off")), requests))
    ahead_engine = Engine(tiny, replace(config, overlap="on"))
    assert by_request(run(ahead_engine, requests)) == plain
    assert {reason for _, _, reason, _ in plain.values()} == {"length"}
    assert all(len(prompt) + len(plain[f"r{i}"][0]) == 50 for i, (prompt, _) in enumerate(requests))
    assert_clean(ahead_engine)


def test_steps_run_ahead_reading_the_pending_tokens_on_the_device(tiny, prompts, monkeypatch) -> None:
    pending_reads = []
    run_step = ModelRunner.run

    def spy(self, batch, pending=None):
        if pending is not None:
            pending_reads.append(sum(1 for s in batch.seqs if s.output_ids and s.output_ids[-1] == PENDING_TOKEN))
        return run_step(self, batch, pending)

    monkeypatch.setattr(ModelRunner, "run", spy)
    engine = Engine(tiny, EngineConfig(num_blocks=200, overlap="on"))
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    first = engine.step()  # the first prompt runs (the others wait to hit its prefix); its token stays on the device
    assert first == [] and engine.in_flight is not None
    assert [s.output_ids for s in engine.scheduler.running] == [[PENDING_TOKEN]]
    second = engine.step()  # the next step runs on it (and the other prompts), then the first token is read
    assert [(d.request_id, len(d.token_ids)) for d in second] == [("r0", 1)]
    assert PENDING_TOKEN not in second[0].token_ids
    assert pending_reads == [1]
    assert all(s.output_ids[-1] == PENDING_TOKEN and PENDING_TOKEN not in s.output_ids[:-1]
               for s in engine.scheduler.running)
    while engine.has_work():
        engine.step()
    assert len(pending_reads) == GREEDY.max_tokens  # every step after the first read the step before's tokens
    assert max(pending_reads) == 4
    assert_clean(engine)


def test_logprobs_and_penalties_run_ahead_with_the_plain_steps_results(tiny, prompts, monkeypatch) -> None:
    """The draw comes after the step before is read: penalties see the output so far, and the chosen and top
    logprobs travel to the host with the tokens."""
    ahead_reads = []
    run_step = ModelRunner.run
    monkeypatch.setattr(ModelRunner, "run", lambda self, batch, pending=None: (
        ahead_reads.append(pending is not None), run_step(self, batch, pending))[1])
    requests = [(prompts[0], SamplingParams(max_tokens=8, temperature=0.0, logprobs=3, ignore_eos=True)),
                (prompts[1], SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, frequency_penalty=1.5,
                                            presence_penalty=0.5, repetition_penalty=1.3, ignore_eos=True)),
                (prompts[2], SamplingParams(max_tokens=8, temperature=0.8, seed=5, repetition_penalty=1.2,
                                            ignore_eos=True)),
                (prompts[3], GREEDY)]
    plain = run(Engine(tiny, EngineConfig(num_blocks=200, overlap="off")), requests)
    ahead_reads.clear()
    engine = Engine(tiny, EngineConfig(num_blocks=200, overlap="on"))
    ahead = run(engine, requests)
    assert by_request(ahead) == by_request(plain)
    for request_id in ("r0", "r1"):
        streamed = [(d.logprobs, d.top_logprobs) for d in ahead if d.request_id == request_id and d.token_ids]
        assert streamed == [(d.logprobs, d.top_logprobs) for d in plain if d.request_id == request_id and d.token_ids]
        assert len(streamed) == 8 and all(lp is not None and top is not None for lp, top in streamed)
    assert all(len(top[0]) == 3 for d in ahead if d.request_id == "r0" and (top := d.top_logprobs))
    assert sum(ahead_reads) >= 8  # they ran ahead
    assert_clean(engine)


def test_a_request_that_needs_the_host_steps_plainly_beside_the_others(tiny, prompts, monkeypatch) -> None:
    """Prompt logprobs (computed whole, with the step's hidden states) keep every step plain while the
    request is running or waiting; the others run ahead before and after."""
    pending_seen = []
    run_step = ModelRunner.run

    def spy(self, batch, pending=None):
        pending_seen.append((pending is not None, any(s.request_id == "r1" for s in batch.seqs)))
        return run_step(self, batch, pending)

    monkeypatch.setattr(ModelRunner, "run", spy)
    scoring = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=2, ignore_eos=True)
    requests = [(prompts[0], GREEDY), (prompts[1], scoring), (prompts[2], GREEDY)]
    plain = run(Engine(tiny, EngineConfig(num_blocks=200, overlap="off")), requests)
    pending_seen.clear()
    engine = Engine(tiny, EngineConfig(num_blocks=200, overlap="on"))
    ahead = run(engine, requests)
    assert by_request(ahead) == by_request(plain)
    scored = [d.prompt_logprobs for d in ahead if d.request_id == "r1" and d.prompt_logprobs]
    assert scored == [d.prompt_logprobs for d in plain if d.request_id == "r1" and d.prompt_logprobs] and scored
    assert not any(ran_ahead for ran_ahead, with_scoring in pending_seen if with_scoring)
    assert any(ran_ahead for ran_ahead, _ in pending_seen)  # after it ended, the others ran ahead again
    assert_clean(engine)


def test_an_abort_reads_the_step_in_flight_first(tiny, prompts) -> None:
    engine = Engine(tiny, EngineConfig(num_blocks=200, max_batch_tokens=16, overlap="on"))
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    deltas = []
    while not any(s.output_len > 2 for s in engine.scheduler.running):
        deltas += engine.step()
    seq = engine.sequences["r0"]
    final = engine.abort("r0")
    assert final is not None and final.finish_reason == "abort" and final.usage is not None
    assert PENDING_TOKEN not in seq.output_ids
    assert final.usage["completion_tokens"] == seq.output_len > 0
    while engine.has_work():
        deltas += engine.step()
    streamed = by_request(deltas)
    assert streamed["r0"][0] == seq.output_ids  # every token it was billed for was streamed (carried over)
    assert {r for r, (_, _, reason, _) in streamed.items() if reason == "length"} == {"r1", "r2", "r3"}
    assert_clean(engine)


def test_overlap_is_on_by_default_only_on_cuda() -> None:
    assert enabled("auto", "cuda") and not enabled("auto", "cpu")
    assert enabled("on", "cpu") and not enabled("off", "cuda")


def test_captured_steps_read_the_pending_tokens_too(tiny, prompts) -> None:
    """Through DecodeGraphs (its CPU stand-in replays the captured call on the static buffers): the pending
    tokens filled into the step's ids reach the graph's static input, and the tokens are the plain engine's.
    On the native backend: the stand-in's replay sizes the torch backend's attention by the bucket's context."""
    from kernels.cpu import native
    from tests.required import unavailable
    from workers.engine.cuda_graphs import DecodeGraphs

    if not native.load():
        unavailable(str(native.unavailable_reason()))
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    expected = [s.output_ids for s in Engine(tiny, EngineConfig(num_blocks=60)).generate_batch(prompts, params)]
    engine = Engine(tiny, EngineConfig(num_blocks=60, overlap="on"))
    kv = tiny.model.allocate_kv(61, engine.runner.kv.block_size)  # one more page than the pool hands out: padding's
    graphs = DecodeGraphs(tiny.model, kv, 60, "native", buckets=(1, 2, 4))
    engine.runner = ModelRunner(tiny.model, kv, "native", graphs)
    assert [s.output_ids for s in engine.generate_batch(prompts, params)] == expected
    assert (4, 256) in graphs.graphs and graphs.failed is None
    assert_clean(engine)


def test_n_choices_fork_and_run_ahead_as_plain_steps_do(tiny, prompts) -> None:
    """A request with n = 3 (seeded sampling) and one greedy beside it: the choices forked in an overlapped
    step draw from their parent's row and then run ahead, giving the plain steps' tokens per choice."""
    requests = [(prompts[3], SamplingParams(max_tokens=7, temperature=1.0, seed=500, n=3, ignore_eos=True)),
                (prompts[1], GREEDY)]

    def per_choice(deltas: list[Delta]) -> dict[tuple[str, int], list[int]]:
        out: dict[tuple[str, int], list[int]] = {}
        for d in deltas:
            out.setdefault((d.request_id, d.index), []).extend(d.token_ids)
        return out

    plain = per_choice(run(Engine(tiny, EngineConfig(num_blocks=200, overlap="off")), requests))
    engine = Engine(tiny, EngineConfig(num_blocks=200, overlap="on"))
    ahead = per_choice(run(engine, requests))
    assert ahead == plain and len(plain) == 4 and all(len(v) == 7 for k, v in plain.items() if k[0] == "r0")
    assert len({tuple(v) for k, v in plain.items() if k[0] == "r0"}) > 1  # the choices differ
    assert_clean(engine)
