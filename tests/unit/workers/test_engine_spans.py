"""The engine's phase spans (workers/engine/phase_spans.py) on a tiny model, from the SDK's
in-memory exporter: queue wait, prefill chunks with cached/new tokens, decode, preemptions."""

from __future__ import annotations

import itertools
import time

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import set_span_in_context

from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.engine.phase_spans import TraceParent
from workers.models.loader import LoadedModel
from workers.wire.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [list(range(3, 43)) + list(range(50, 50 + n)) for n in (5, 17, 1, 30)]


@pytest.fixture
def traced():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test"), exporter


def run(engine: Engine, tracer, prompts: list[list[int]], params: SamplingParams = GREEDY) -> dict[str, object]:
    """Runs the prompts to completion, each under its own parent span; request id -> parent span."""
    parents = {}
    for i, prompt in enumerate(prompts):
        parent = tracer.start_span(f"parent-{i}")
        parents[f"r{i}"] = parent
        engine.add_request(f"r{i}", prompt, params, trace=TraceParent(set_span_in_context(parent), time.time_ns()))
    while engine.has_work():
        engine.step()
    for parent in parents.values():
        parent.end()
    return parents


def children(exporter: InMemorySpanExporter, parent) -> list:
    pid = parent.get_span_context().span_id
    return sorted((s for s in exporter.get_finished_spans() if s.parent is not None and s.parent.span_id == pid),
                  key=lambda s: (s.start_time, s.name))


def test_phases_of_one_request_in_order_with_token_counts(tiny: LoadedModel, traced) -> None:
    tracer, exporter = traced
    engine = Engine(tiny, EngineConfig(num_blocks=200, block_size=8, max_batch_tokens=16), tracer=tracer)
    [parent] = run(engine, tracer, [PROMPTS[3]]).values()
    spans = children(exporter, parent)
    names = [s.name for s in spans]
    # 70 prompt tokens in chunks of 16: 5 prefill chunks, then one decode span (no span per token)
    assert names == ["engine.queue_wait"] + ["engine.prefill"] * 5 + ["engine.decode"]
    prefills = [s for s in spans if s.name == "engine.prefill"]
    assert [s.attributes["tollway.prefill.new_tokens"] for s in prefills] == [16, 16, 16, 16, 6]
    assert [s.attributes["tollway.prefill.position"] for s in prefills] == [0, 16, 32, 48, 64]
    assert all(s.attributes["tollway.prefill.cached_tokens"] == 0 for s in prefills)
    decode = spans[-1]
    assert decode.attributes["tollway.decode.steps"] == GREEDY.max_tokens - 1  # the first token ends the prefill
    assert decode.attributes["tollway.finish_reason"] == "length"
    for earlier, later in itertools.pairwise(spans):
        assert earlier.end_time <= later.start_time + 1  # phases follow one another
    assert all(s.start_time <= s.end_time for s in spans)
    assert spans[0].start_time >= parent.start_time and decode.end_time <= parent.end_time


def test_a_cached_prefix_shows_in_the_first_prefill_chunk(tiny: LoadedModel, traced) -> None:
    tracer, exporter = traced
    engine = Engine(tiny, EngineConfig(num_blocks=200, block_size=8), tracer=tracer)
    run(engine, tracer, [PROMPTS[0]])
    exporter.clear()
    [parent] = run(engine, tracer, [PROMPTS[1]]).values()  # shares the 40-token prefix
    [prefill] = [s for s in children(exporter, parent) if s.name == "engine.prefill"]
    # five whole cached blocks of 8, plus 5 tokens copied from the block the prompt continues into
    assert prefill.attributes["tollway.prefill.cached_tokens"] == 45
    assert prefill.attributes["tollway.prefill.new_tokens"] == len(PROMPTS[1]) - 45


def test_preemptions_are_spans_and_requeue_the_sequence(tiny: LoadedModel, traced) -> None:
    tracer, exporter = traced
    engine = Engine(tiny, EngineConfig(num_blocks=12, block_size=8), tracer=tracer)  # cannot hold all four
    parents = run(engine, tracer, PROMPTS)
    assert engine.info()["preemptions"] > 0
    preempted = [s for s in exporter.get_finished_spans() if s.name == "engine.preemption"]
    assert len(preempted) == engine.info()["preemptions"]
    for parent in parents.values():
        spans = children(exporter, parent)
        waits = [s for s in spans if s.name == "engine.queue_wait"]
        mine = [s for s in spans if s.name == "engine.preemption"]
        assert len(waits) == 1 + len(mine)  # each preemption sends it back to the queue
        assert [w.attributes["tollway.after_preemption"] for w in waits] == [False] + [True] * len(mine)
        assert spans[-1].name == "engine.decode" and spans[-1].attributes["tollway.finish_reason"] == "length"
    assert not engine._phases._followed  # nothing followed once every request finished


def test_n_choices_decode_separately_and_untraced_requests_make_no_spans(tiny: LoadedModel, traced) -> None:
    tracer, exporter = traced
    engine = Engine(tiny, EngineConfig(num_blocks=200), tracer=tracer)
    engine.add_request("untraced", PROMPTS[0], GREEDY)
    [parent] = run(engine, tracer, [PROMPTS[2]], SamplingParams(max_tokens=4, temperature=0.0, n=3,
                                                                  ignore_eos=True)).values()
    decodes = [s for s in children(exporter, parent) if s.name == "engine.decode"]
    assert sorted(s.attributes["tollway.choice.index"] for s in decodes) == [0, 1, 2]
    assert {s.parent.span_id for s in exporter.get_finished_spans() if s.name.startswith("engine.")} == \
        {parent.get_span_context().span_id}


def test_without_a_tracer_the_engine_follows_nothing(tiny: LoadedModel) -> None:
    engine = Engine(tiny, EngineConfig(num_blocks=200))
    assert engine._phases is None
    engine.generate_batch(PROMPTS[:2], GREEDY)
