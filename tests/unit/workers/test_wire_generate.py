"""The worker protocol's joined answer (workers/wire/generate.py LineJoiner), without a server."""

from __future__ import annotations

import pytest

from workers.wire.generate import BadRequest, LineJoiner, parse_generate


def test_line_joiner_joins_each_choice_and_puts_the_usage_line_last() -> None:
    joiner = LineJoiner()
    deltas = [({"index": 1, "token_ids": [7], "text": "a", "finish_reason": None, "logprobs": [-1.0]}, 10.0),
              ({"index": 0, "token_ids": [8], "text": "b", "finish_reason": None, "logprobs": [-2.0]}, 10.5),
              ({"index": 1, "token_ids": [9], "text": "c", "finish_reason": "stop", "logprobs": [-3.0]}, 12.0),
              ({"index": 0, "token_ids": [], "text": "", "finish_reason": "abort",
                "usage": {"prompt_tokens": 4, "cached_tokens": 0, "completion_tokens": 3}}, 13.0)]
    for delta, now in deltas:
        joiner.add(delta, now)
    first, last = joiner.lines()
    assert first == {"index": 1, "token_ids": [7, 9], "text": "ac", "finish_reason": "stop", "decode_s": 2.0,
                     "logprobs": [-1.0, -3.0]}
    assert last["index"] == 0 and last["token_ids"] == [8] and last["finish_reason"] == "abort"
    assert last["decode_s"] == 0.0 and last["usage"]["completion_tokens"] == 3  # an empty delta adds no time


def test_grammar_field_rides_beside_sampling() -> None:
    from workers.wire.generate import generate_body
    from workers.wire.grammar import GrammarSpec, TagSpec

    spec = GrammarSpec.json_schema({"type": "object", "properties": {"b": {}, "a": {}}})
    parsed = parse_generate(generate_body("r", "ns", [1, 2], {"max_tokens": 4}, grammar=spec))
    assert parsed.params.grammar == spec and parsed.params.max_tokens == 4
    assert spec.schema == '{"type":"object","properties":{"b":{},"a":{}}}'  # property order kept
    tags = GrammarSpec("tool_tags", tags=(TagSpec("<tool_call>{", '{"type":"object"}', "}"),), triggers=("<tool_call>",))
    again = parse_generate({"request_id": "r", "prompt_token_ids": [1], "grammar": tags.to_json()})
    assert again.params.grammar == tags and again.params.grammar.key == tags.key != spec.key
    assert parse_generate({"request_id": "r", "prompt_token_ids": [1]}).params.grammar is None


@pytest.mark.parametrize("grammar, message", [
    ("json", "grammar must be an object"),
    ({"type": "regex"}, "grammar.type must be one of"),
    ({"type": "json_schema", "schema": "{nope"}, "not JSON"),
    ({"type": "json_schema", "schema": "[1]"}, "JSON schema object"),
    ({"type": "tool_tags", "tags": [{"begin": "x", "schema": "{}", "end": "y"}], "triggers": ["<t>"]},
     "begin with one of the triggers"),
])
def test_bad_grammar_fields_are_bad_requests(grammar, message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        parse_generate({"request_id": "r", "prompt_token_ids": [1], "grammar": grammar})
    with pytest.raises(BadRequest, match="unknown sampling fields: grammar"):
        parse_generate({"request_id": "r", "prompt_token_ids": [1], "sampling": {"grammar": {}}})
