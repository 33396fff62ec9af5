"""Replay a ledger journal through a fresh ``Ledger`` and policy: same inputs, same decisions.

A shell's journal (``Ledger.start_journal``) holds every turn event it reported, every
engine report (free HBM, tokens generated) and, per pull, the view the policy saw and the
assignments it made; per forward pass, the PE's queue and the plan. ``replay`` feeds the
events to a new ledger and the pulls and plans to a new policy, and raises ``ReplayMismatch``
at the first record whose view or decision differs. The simulator and the runtime write the
same records, so one replay checks both.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from dualpath.ledger.journal import encode_assign, encode_view
from dualpath.ledger.ledger import Ledger
from dualpath.ledger.topology import Topology
from dualpath.ledger.turn import Turn
from dualpath.policy import Assign
from dualpath.policy.base import PendingPrefill, Policy
from dualpath.types import ReadSide

# the ledger inputs a replay feeds back, in the order a shell reports them
TURN_OPS = (
    "submit",
    "assign",
    "read_started",
    "read_done",
    "pass_started",
    "chunk_done",
    "first_token",
    "loaded",
    "finish",
    "abort",
)


class ReplayMismatch(AssertionError):
    """A replayed view or decision differs from the journal's."""


@dataclass(frozen=True, slots=True)
class ReplayStats:
    records: int
    pulls: int
    assignments: int
    plans: int
    chunks: int


def _assign(fields: list[Any]) -> Assign:
    rid, pe, de, side, pe_tokens, de_tokens = fields
    return Assign(rid, pe, de, ReadSide(side), pe_tokens, de_tokens)


def replay(records: Iterable[Mapping[str, Any]], topology: Topology, policy: Policy) -> ReplayStats:
    """Feed ``records`` (a journal, ``init`` first) to a fresh ledger on ``topology`` and to
    ``policy`` (fresh, made from the same config as the recorded run's)."""
    it = iter(records)
    init = next(it, None)
    if init is None or init.get("op") != "init":
        raise ReplayMismatch("a journal starts with its init record")
    ledger = Ledger(topology, init["hbm_capacity_tokens"], init["block_tokens"])
    values: dict[tuple[int, ...], list[int]] = {}
    for group in init["decode_groups"]:
        members = tuple(group)
        values[members] = [0] * len(members)
        ledger.track_decode(members, lambda m=members: values[m])  # type: ignore[misc]
    for e, tokens in enumerate(init["free_hbm"] or ()):
        if tokens >= 0:
            ledger.report_free_hbm(e, tokens)
    turns: dict[int, Turn] = {}
    decided: list[list[Any]] = []  # the last pull's assignments not yet carried out
    pulls = assignments = plans = chunks = 0
    n = 0
    for n, rec in enumerate(it, start=1):
        op, t = rec["op"], rec.get("t", 0.0)
        where = f"journal record {n} ({op} at t={t})"
        if op == "submit":
            turn = Turn(
                rec["id"],
                rec["agent"],
                rec["turn"],
                rec["prompt"],
                rec["hit"],
                rec["output"],
                rec["arrival"],
            )
            turns[turn.request_id] = turn
            policy.submit(ledger.submit(turn, t), t)
        elif op == "pull":
            view = ledger.view()
            got = encode_view(view)
            if got != rec["view"]:
                raise ReplayMismatch(f"{where}: view {got} != recorded {rec['view']}")
            again = [encode_assign(a) for a in policy.schedule(view, t)]
            if again != rec["assigns"]:
                raise ReplayMismatch(f"{where}: assigns {again} != recorded {rec['assigns']}")
            if decided:
                raise ReplayMismatch(f"{where}: assignments {decided} were never carried out")
            decided = list(again)
            pulls += 1
            assignments += len(again)
        elif op == "assign":
            if not decided or decided[0] != rec["a"]:
                raise ReplayMismatch(f"{where}: {rec['a']} is not the next decision {decided[:1]}")
            decided.pop(0)
            ledger.assign(turns[rec["a"][0]], _assign(rec["a"]), t, rec["read"])
        elif op == "plan":
            pending = [PendingPrefill(*p) for p in rec["pending"]]
            batch = policy.plan_forward(rec["pe"], pending, t, rec["budget"], rec.get("cap"))
            again = [[c.request_id, c.cached, c.new, c.is_last] for c in batch.chunks]
            if again != rec["chunks"]:
                raise ReplayMismatch(f"{where}: plan {again} != recorded {rec['chunks']}")
            plans += 1
            chunks += len(again)
        elif op == "read_started":
            ledger.read_started(turns[rec["id"]], rec["node"], rec["bytes"], t)
        elif op == "read_done":
            ledger.read_done(turns[rec["id"]], rec["node"], t)
        elif op == "pass_started":
            ledger.pass_started(turns[rec["id"]], t)
        elif op == "chunk_done":
            ledger.chunk_done(turns[rec["id"]], rec["new"], t)
        elif op == "first_token":
            ledger.first_token(turns[rec["id"]], t)
        elif op == "loaded":
            ledger.loaded(turns[rec["id"]], t)
        elif op == "finish":
            turn = turns.pop(rec["id"])
            turn.prefill_start_s, turn.second_token_s, turn.finish_s = rec["times"]
            turn.hit_tokens = rec["hit"]
            ledger.finish(turn, t)
        elif op == "abort":
            ledger.abort(turns.pop(rec["id"]), t)
        elif op == "free_hbm":
            ledger.report_free_hbm(rec["engine"], rec["tokens"])
        elif op == "generated":
            values[tuple(rec["members"])][:] = rec["values"]
        else:
            raise ReplayMismatch(f"{where}: unknown op {op!r}")
    return ReplayStats(n + 1, pulls, assignments, plans, chunks)
