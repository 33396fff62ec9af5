"""``relay.py``: the decode's answer with the store's hits as ``cached_tokens``, SSE events
re-cut whole wherever the wire split them, tokens counted, ``[DONE]`` seen."""

from __future__ import annotations

import json

from dualpath.integrations.vllm.relay import EventRelay, with_cached_tokens

# as vLLM 0.32 writes them (pydantic's compact JSON)
OPENING = b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}\n\n'
TOKEN = b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"hi \\"usage\\":{"},"logprobs":null,"finish_reason":null}]}\n\n'
USAGE = b'data: {"id":"c","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":100,"total_tokens":104,"completion_tokens":4,"prompt_tokens_details":{"cached_tokens":99}}}\n\n'
DONE = b"data: [DONE]\n\n"


def test_events_cut_anywhere_come_out_whole_with_the_hits() -> None:
    wire = OPENING + TOKEN + TOKEN + USAGE + DONE
    for cut in range(1, 40):
        relay = EventRelay(cached_tokens=64)
        pieces = [wire[i : i + cut] for i in range(0, len(wire), cut)]
        out = b"".join(relay.feed(p) for p in pieces) + relay.flush()
        events = out.split(b"\n\n")[:-1]
        assert events[:3] == [e.rstrip(b"\n") for e in (OPENING, TOKEN, TOKEN)]  # untouched
        usage = json.loads(events[3][6:])["usage"]
        assert usage["prompt_tokens_details"] == {"cached_tokens": 64}
        assert usage["prompt_tokens"] == 100
        assert events[4] == b"data: [DONE]" and relay.done
        assert relay.take_tokens() == 2 and relay.take_tokens() == 0


def test_done_is_seen_before_the_stream_ends() -> None:
    relay = EventRelay(0)
    assert relay.feed(TOKEN + b"data: [DO") == TOKEN and not relay.done
    assert relay.feed(b"NE]\n\n") == DONE and relay.done


def test_whole_answers_get_the_field_always() -> None:
    whole = {
        "id": "c",
        "choices": [],
        "usage": {"prompt_tokens": 10, "prompt_tokens_details": None},
    }
    got = json.loads(with_cached_tokens(json.dumps(whole).encode(), 32))
    assert got["usage"] == {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 32}}
    assert with_cached_tokens(b'{"error": {"message": "x"}}', 32) == b'{"error": {"message": "x"}}'
    assert with_cached_tokens(b"not json", 32) == b"not json"
