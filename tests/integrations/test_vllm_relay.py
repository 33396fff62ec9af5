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


def _chunk(index: int, text: str, so_far: int | None) -> bytes:
    """A choice event as vLLM writes it with ``continuous_usage_stats`` (None: without)."""
    usage = (
        f',"usage":{{"prompt_tokens":9,"total_tokens":{9 + so_far},"completion_tokens":{so_far}}}'
        if so_far is not None
        else ""
    )
    return (
        f'data: {{"id":"c","object":"chat.completion.chunk","choices":[{{"index":{index},'
        f'"delta":{{"content":"{text}"}},"logprobs":null,"finish_reason":null}}]{usage}}}\n\n'
    ).encode()


def test_tokens_are_counted_from_the_usage_when_vllm_merges_steps() -> None:
    # choice 0 sends 3 tokens in one event (merged steps), then 1; choice 1 sends 2 then 2
    wire = _chunk(0, "a b c", 3) + _chunk(1, "x y", 2) + _chunk(0, "d", 4) + _chunk(1, "z w", 4)
    relay = EventRelay(0, include_usage=False, continuous=False)
    out = relay.feed(wire)
    assert relay.take_tokens() == 8
    # the client asked for no usage: every event is vLLM's own without it
    plain = _chunk(0, "a b c", None) + _chunk(1, "x y", None)
    plain += _chunk(0, "d", None) + _chunk(1, "z w", None)
    assert out == plain
    closing = USAGE.replace(b'"completion_tokens":4', b'"completion_tokens":8')
    assert relay.feed(closing + DONE) == DONE and relay.done


def test_usage_the_client_asked_for_stays() -> None:
    wire = _chunk(0, "a b", 2) + USAGE
    only_closing = EventRelay(5, include_usage=True, continuous=False)
    out = only_closing.feed(wire).split(b"\n\n")
    assert out[0] + b"\n\n" == _chunk(0, "a b", None)
    assert json.loads(out[1][6:])["usage"]["prompt_tokens_details"] == {"cached_tokens": 5}
    every = EventRelay(5, include_usage=True, continuous=True)
    first = json.loads(every.feed(_chunk(0, "a b", 2)).split(b"\n\n")[0][6:])
    assert first["usage"]["completion_tokens"] == 2
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 5}
    assert every.take_tokens() == 2
