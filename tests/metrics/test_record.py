"""TurnRecord: metric definitions on a hand-built timeline and timeline validation."""

from __future__ import annotations

import dataclasses

import pytest

from dualpath.metrics import TurnRecord
from dualpath.types import ReadSide


def record(**changes: object) -> TurnRecord:
    base = TurnRecord(
        agent_id=1,
        turn_index=0,
        request_id=10,
        arrival_s=2.0,
        scheduled_s=2.5,
        read_start_s=3.0,
        read_done_s=4.5,
        prefill_start_s=4.75,
        first_token_s=5.0,
        second_token_s=5.5,
        finish_s=6.5,
        prompt_tokens=1000,
        hit_tokens=960,
        output_tokens=6,
        read_side="de",
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def test_definitions() -> None:
    r = record()
    assert r.ttft_s == 3.0
    assert r.ttst_s == 0.5  # from the first token (5.0) to the second (5.5)
    assert r.tpot_s == pytest.approx(1.0 / 4)  # tokens 3..6 over 4 intervals after token 2
    assert (r.queue_s, r.alloc_s, r.read_s, r.prefill_s) == (0.5, 0.5, 1.5, 0.5)
    assert r.queue_s + r.alloc_s + r.read_s + r.prefill_s == r.ttft_s


def test_short_outputs_have_no_ttst_or_tpot() -> None:
    one = record(output_tokens=1, second_token_s=5.0, finish_s=5.0)
    assert one.ttst_s is None and one.tpot_s is None
    two = record(output_tokens=2, finish_s=5.5)
    assert two.ttst_s == 0.5 and two.tpot_s is None
    three = record(output_tokens=3, finish_s=5.75)
    assert three.tpot_s == 0.25


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"scheduled_s": 1.0}, "scheduled_s"),
        ({"read_done_s": 2.9}, "read_done_s"),
        ({"prefill_start_s": 4.0}, "prefill_start_s"),
        ({"first_token_s": 4.6}, "first_token_s"),
        ({"second_token_s": 4.9}, "second_token_s"),
        ({"finish_s": 5.4}, "finish_s"),
        ({"arrival_s": -1.0}, "arrival_s"),
        ({"arrival_s": float("nan")}, "arrival_s"),
        ({"hit_tokens": 1001}, "hit_tokens"),
        ({"output_tokens": 0}, "output_tokens"),
        ({"output_tokens": 1}, "second_token_s"),
        ({"request_id": -1}, "request_id"),
    ],
)
def test_invalid_timeline_names_the_field(changes: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        record(**changes)


def test_read_side_enum_is_stored_as_its_value() -> None:
    r = record(read_side=ReadSide.DE)
    assert r.read_side == "de" and type(r.read_side) is str
    with pytest.raises(ValueError, match="read_side"):
        record(read_side="")
