"""The worker protocol's joined answer (workers/wire/generate.py LineJoiner), without a server."""

from __future__ import annotations

from workers.wire.generate import LineJoiner


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
