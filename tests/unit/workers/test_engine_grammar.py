"""Grammar-constrained decoding in the engine, on a tiny random-weight model whose vocabulary spells
JSON one character per token: every constrained output parses and validates, whatever the batch
(mixed with free rows, chunked, preempted, n > 1 forks), and free rows are untouched."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer, models

from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.engine.grammar import GrammarCompiler, GrammarError, GrammarMasks, accept
from workers.engine.request import FinishReason, Sequence
from workers.generate import SamplingParams as PlainParams
from workers.generate import generate
from workers.models.loader import LoadedModel, load_model
from workers.models.tiny import SPECIAL_TOKENS, tiny_config
from workers.wire.grammar import GrammarSpec
from workers.wire.sampling import SamplingParams

CHARS = list('{}[]":, <>/_\n') + [str(d) for d in range(10)] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["ab", "cd"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
        "inner": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
                  "required": ["x"], "additionalProperties": False},
    },
    "required": ["kind", "n", "ok", "tags", "inner"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """The tiny model with a character vocabulary (and filler words up to its vocab size)."""
    from safetensors.torch import save_file

    from workers.models.tiny import tiny_weights

    folder = tmp_path_factory.mktemp("grammar") / "m"
    folder.mkdir()
    config = tiny_config("llama")
    words = SPECIAL_TOKENS + CHARS
    words += [f"w{i}" for i in range(config["vocab_size"] - len(words))]
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tiny_weights(config, 5), str(folder / "model.safetensors"))
    tokenizer = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "unk_token": "<unk>"}))
    return load_model(folder, torch.float32)


def spelled(tiny: LoadedModel, ids: list[int]) -> str:
    vocab = {i: w for w, i in Tokenizer.from_file(str(tiny.folder / "tokenizer.json")).get_vocab().items()}
    return "".join(vocab[i] for i in ids)


def constrained(**kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=120, grammar=GrammarSpec.json_schema(SCHEMA), **kwargs)


def prompts(count: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    system = torch.randint(3, 131, (20,), generator=gen).tolist()
    return [system + torch.randint(3, 131, (3 + i,), generator=gen).tolist() for i in range(count)]


def assert_valid(tiny: LoadedModel, seq: Sequence) -> dict:
    assert seq.finish_reason is FinishReason.STOP, spelled(tiny, seq.output_ids)
    value = json.loads(spelled(tiny, seq.output_ids))
    jsonschema.validate(value, SCHEMA)
    return value


@pytest.mark.parametrize("config", [EngineConfig(num_blocks=200), EngineConfig(num_blocks=200, max_batch_tokens=16),
                                    EngineConfig(num_blocks=14, block_size=8)],
                         ids=["batched", "chunked", "preempting"])
def test_constrained_rows_validate_and_free_rows_are_untouched(tiny: LoadedModel, config: EngineConfig) -> None:
    engine = Engine(tiny, config)
    batch = prompts(6)
    free = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    params = [constrained(temperature=1.0, seed=i) if i % 2 == 0 else free for i in range(6)]
    seqs = engine.generate_batch(batch, params)
    for i, seq in enumerate(seqs):
        if i % 2 == 0:
            assert_valid(tiny, seq)
        else:
            assert seq.output_ids == generate(tiny.model, [batch[i]], PlainParams(max_new_tokens=10))[0]
    if config.num_blocks == 14:
        assert engine.scheduler.preemptions > 0  # the matchers survived recomputation
    engine.check_integrity()
    assert engine.all_blocks_free_or_evictable()


def test_greedy_constrained_output_is_the_same_alone_or_batched(tiny: LoadedModel) -> None:
    alone = Engine(tiny, EngineConfig(num_blocks=200)).generate_batch(prompts(1), constrained(temperature=0.0))
    batched = Engine(tiny, EngineConfig(num_blocks=200)).generate_batch(
        prompts(3), [constrained(temperature=0.0), SamplingParams(max_tokens=5), constrained(temperature=0.7)])
    assert alone[0].output_ids == batched[0].output_ids
    assert_valid(tiny, alone[0])


def test_n_choices_fork_the_matcher(tiny: LoadedModel) -> None:
    engine = Engine(tiny, EngineConfig(num_blocks=200))
    engine.add_request("r", prompts(1)[0], constrained(temperature=1.0, seed=7, n=4))
    tokens: dict[int, list[int]] = {i: [] for i in range(4)}
    reasons = {}
    while engine.has_work():
        for delta in engine.step():
            tokens[delta.index] += delta.token_ids
            if delta.finish_reason is not None:
                reasons[delta.index] = delta.finish_reason
    assert reasons == {0: "stop", 1: "stop", 2: "stop", 3: "stop"}
    values = [json.loads(spelled(tiny, ids)) for ids in tokens.values()]
    for value in values:
        jsonschema.validate(value, SCHEMA)
    assert len({json.dumps(v, sort_keys=True) for v in values}) > 1  # each choice drew its own tokens


def test_an_unsupported_schema_is_a_value_error(tiny: LoadedModel) -> None:
    engine = Engine(tiny, EngineConfig(num_blocks=50))
    bad = GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "nonsense"}}}))
    with pytest.raises(GrammarError, match="constrained decoding"):
        engine.add_request("bad", [5, 6], SamplingParams(grammar=bad))
    assert not engine.has_work()


def test_masks_allow_exactly_what_the_matcher_accepts(tiny: LoadedModel) -> None:
    compiler = GrammarCompiler(tiny.folder, 131, [2])
    spec = GrammarSpec.json_schema(SCHEMA)
    assert compiler.compile(spec) is compiler.compile(GrammarSpec.json_schema(json.loads(spec.schema or "")))
    vocab = Tokenizer.from_file(str(tiny.folder / "tokenizer.json")).get_vocab()
    seqs = [Sequence("a", [1], SamplingParams()), Sequence("b", [1], SamplingParams(grammar=spec))]
    seqs[1].matcher = compiler.matcher(spec)
    for char in '{"kind": "':
        assert accept(seqs[1], vocab[char])
    masks = GrammarMasks(131)
    logits = torch.zeros(2, 131)
    masks.constrain(logits, seqs, masks.start(seqs), 2)
    assert torch.all(logits[0] == 0)  # a free row is untouched
    allowed = {i for i in range(131) if logits[1, i] == 0}
    assert allowed == {vocab["a"], vocab["c"]}  # "ab" or "cd"
    assert masks.rows_filled == 1
    rebuilt = compiler.rebuild(spec, [vocab[c] for c in '{"kind": "'])
    assert rebuilt.accept_token(vocab["c"]) and not rebuilt.accept_token(vocab["a"])
    with pytest.raises(GrammarError):
        compiler.rebuild(spec, [vocab["}"]])


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_calls_are_calls_only_with_valid_arguments(tiny: LoadedModel, parallel: bool) -> None:
    from gateway.openai.params import parse_request
    from gateway.openai.tool_stream import CallEnded, Text, ToolCallParser

    tools = [{"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}, "ok": {"type": "boolean"}},
        "required": ["n", "ok"], "additionalProperties": False}}} for name in ("ab", "cd")]
    request = parse_request("chat", {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": tools,
                                     "tool_choice": "required", "parallel_tool_calls": parallel})
    engine = Engine(tiny, EngineConfig(num_blocks=200))
    params = [SamplingParams(max_tokens=300, temperature=1.0, seed=i, grammar=request.grammar) for i in range(4)]
    for seq in engine.generate_batch(prompts(4), params):
        # one call then the end; in parallel, random weights may keep calling until max_tokens
        assert seq.finish_reason is FinishReason.STOP or parallel, spelled(tiny, seq.output_ids)
        parser = ToolCallParser()
        events = parser.feed(spelled(tiny, seq.output_ids)) + parser.finish()
        texts = [e.text for e in events if isinstance(e, Text)]
        if seq.finish_reason is FinishReason.LENGTH and texts and texts[-1].startswith("<tool_call>"):
            texts.pop()  # a call cut by max_tokens before its name was complete
        assert texts == []  # calls only, no free text
        ended = [e.call for e in events if isinstance(e, CallEnded)]
        assert ended and (parallel or len(parser.calls) == 1)
        for call in ended:
            assert call.name in ("ab", "cd")
            jsonschema.validate(json.loads(call.arguments), tools[0]["function"]["parameters"])


@pytest.mark.parametrize("config", [EngineConfig(num_blocks=200), EngineConfig(num_blocks=14, block_size=8)],
                         ids=["batched", "preempting"])
def test_overlapped_steps_constrain_as_plain_steps_do(tiny: LoadedModel, config: EngineConfig) -> None:
    """Overlapped steps (workers/engine/overlap.py) fill each step's masks once the matchers took the token
    before: the same valid outputs as plain steps, sampled and greedy, beside unconstrained rows."""
    from dataclasses import replace

    batch = prompts(6)
    free = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    params = [constrained(temperature=1.0, seed=i) if i % 3 == 0 else constrained(temperature=0.0) if i % 3 == 1
              else free for i in range(6)]
    plain = Engine(tiny, replace(config, overlap="off")).generate_batch(batch, params)
    engine = Engine(tiny, replace(config, overlap="on"))
    ahead = engine.generate_batch(batch, params)
    assert [s.output_ids for s in ahead] == [s.output_ids for s in plain]
    for i, seq in enumerate(ahead):
        if i % 3 != 2:
            assert_valid(tiny, seq)
    engine.check_integrity()
    assert engine.all_blocks_free_or_evictable() and engine.in_flight is None
