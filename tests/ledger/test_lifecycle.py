"""A turn's lifecycle: the one table of states and transitions every shell's reports move a turn
through, and the reports it refuses."""

from __future__ import annotations

import pytest

from dualpath.ledger import TRANSITIONS, Ledger, LifecycleError, Phase, Topology, Turn
from dualpath.policy import Assign
from dualpath.types import ReadSide

TOPO = Topology(2, 1, 1, True, True)  # PEs 0, 1 on node 0; DEs 2, 3 on node 1


def _reachable(start: Phase) -> set[Phase]:
    seen, todo = {start}, [start]
    while todo:
        for nxt in TRANSITIONS[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_every_state_is_reachable_and_every_live_one_can_end() -> None:
    assert _reachable(Phase.QUEUED) == set(Phase)
    for phase in Phase:
        ends = _reachable(phase) & {Phase.DONE, Phase.ABORTED}
        assert ends or phase.over, f"{phase} can never end"
        assert phase.over == (not TRANSITIONS[phase])  # only DONE and ABORTED are final
    # a turn needs its PE until its first token; the policy holds a queued one
    assert {p for p in Phase if p.on_pe} == {
        Phase.SCHEDULED,
        Phase.READING,
        Phase.READY,
        Phase.IN_PASS,
    }


def _turn(ledger: Ledger, hit: int = 128) -> Turn:
    turn = Turn(1, 0, 0, prompt_tokens=300, hit_tokens=hit, output_tokens=4, arrival_s=0.0)
    ledger.submit(turn, 0.0)
    side = ReadSide.PE if hit else ReadSide.NONE
    ledger.assign(turn, Assign(1, 0, 2, side, hit, 0), 0.0)
    return turn


@pytest.mark.parametrize(
    ("before", "report", "message"),
    [
        ([], "first_token", "first_token while scheduled"),
        ([], "read_done", "read_done while scheduled"),
        (["read_started"], "pass_started", "pass_started while reading"),
        (["read_started", "read_done"], "first_token", "first_token while ready"),
        (["read_started", "read_done", "pass_started"], "pass_started", "while in_pass"),
        (["read_started", "read_done", "pass_started"], "finish", "finish while in_pass"),
        (["read_started", "read_done", "pass_started"], "loaded", "loaded twice or while"),
    ],
)
def test_a_report_out_of_order_is_refused_in_one_line(
    before: list[str], report: str, message: str
) -> None:
    ledger = Ledger(TOPO, 10_000, 64)
    turn = _turn(ledger)
    calls = {
        "read_started": lambda: ledger.read_started(turn, 0, 1e3, 1.0),
        "read_done": lambda: ledger.read_done(turn, 0, 2.0),
        "pass_started": lambda: ledger.pass_started(turn, 3.0),
        "first_token": lambda: ledger.first_token(turn, 4.0),
        "finish": lambda: ledger.finish(turn, 5.0),
        "loaded": lambda: ledger.loaded(turn, 5.0),
    }
    for name in before:
        calls[name]()
    phase = turn.phase
    with pytest.raises(LifecycleError, match=message) as err:
        calls[report]()
    assert "\n" not in str(err.value)
    assert turn.phase is phase  # a refused report changes nothing


def test_a_queued_turn_cannot_be_aborted_and_a_turn_with_nothing_to_read_is_ready() -> None:
    ledger = Ledger(TOPO, 10_000, 64)
    queued = Turn(2, 0, 0, prompt_tokens=300, hit_tokens=0, output_tokens=4, arrival_s=0.0)
    ledger.submit(queued, 0.0)
    with pytest.raises(LifecycleError, match="mark it cancelled"):
        ledger.abort(queued, 0.5)
    ready = _turn(ledger, hit=0)
    assert ready.phase is Phase.READY and ready.kv_tokens == 0
