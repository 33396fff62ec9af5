"""The connector's scheduler half (``StepPlanner``) and its params, without vLLM."""

from __future__ import annotations

import pytest

from dualpath.integrations.vllm.params import (
    BlockForward,
    BlockLoad,
    BlockPersist,
    BlockSave,
    TransferParams,
)
from dualpath.integrations.vllm.plan import StepPlanner
from dualpath.kv.store import block_keys

BS = 4


def test_params_round_trip_and_bad_fields() -> None:
    p = TransferParams(
        BlockLoad(0, (3, 4), 8), BlockSave(1, (5, 6, 7), 2), BlockPersist(1, 2, "ns")
    )
    assert TransferParams.from_request({"dualpath": p.to_dict()}) == p
    assert TransferParams.from_request(None) is None
    assert TransferParams.from_request({"do_remote_decode": True}) is None
    with pytest.raises(ValueError, match=r"load\.slots"):
        TransferParams.from_request(
            {"dualpath": {"load": {"node": 0, "slots": [-1], "num_tokens": 4}}}
        )
    with pytest.raises(ValueError, match="unknown field 'loads'"):
        TransferParams.from_request({"dualpath": {"loads": {}}})


def test_prefill_pe_path_loads_hits_and_saves_every_block() -> None:
    """10-token prompt, 8 hit tokens (2 blocks) in PE slots 7, 8; all 3 blocks saved to DE."""
    plan = StepPlanner(BS)
    params = TransferParams(BlockLoad(0, (7, 8), 8), BlockSave(1, (20, 21, 22), 0))
    tokens = list(range(10))
    assert plan.matched_tokens("r", params, tokens, 10, 0) == 8
    plan.allocated("r", 8)
    meta = plan.step([("r", [100, 101, 102], 8, 2)], [])
    assert [(j.node, j.block_ids, j.slots) for j in meta.loads] == [(0, (100, 101), (7, 8))]
    assert [(j.node, j.block_ids, j.slots) for j in meta.saves] == [
        (1, (100, 101, 102), (20, 21, 22))
    ]
    # the prompt is done: the next (decode) step saves nothing more
    later = plan.step([], [("r", None, False, 10, 1)])
    assert later.is_empty()


def test_prefill_de_path_saves_only_the_new_blocks() -> None:
    plan = StepPlanner(BS)
    params = TransferParams(BlockLoad(1, (20, 21), 8), BlockSave(1, (22,), 2))
    assert plan.matched_tokens("r", params, list(range(10)), 10, 0) == 8
    plan.allocated("r", 8)
    meta = plan.step([("r", [100, 101, 102], 8, 2)], [])
    assert [(j.block_ids, j.slots) for j in meta.loads] == [((100, 101), (20, 21))]
    assert [(j.block_ids, j.slots) for j in meta.saves] == [((102,), (22,))]


def test_a_full_prompt_hit_leaves_one_token_to_compute() -> None:
    plan = StepPlanner(BS)
    params = TransferParams(BlockLoad(0, (1, 2), 8), None)
    assert plan.matched_tokens("r", params, list(range(8)), 8, 0) == 7


def test_chunked_prefill_saves_a_partial_block_again_as_it_fills() -> None:
    plan = StepPlanner(BS)
    params = TransferParams(None, BlockSave(1, (30, 31, 32), 0))
    assert plan.matched_tokens("r", params, list(range(10)), 10, 0) == 0
    plan.allocated("r", 0)
    first = plan.step([("r", [5, 6], 0, 6)], [])  # tokens 0..5: block 0 full, block 1 half
    assert [(j.block_ids, j.slots) for j in first.saves] == [((5, 6), (30, 31))]
    second = plan.step([], [("r", [7], False, 6, 4)])  # tokens 6..9: the rest of the prompt
    assert [(j.block_ids, j.slots) for j in second.saves] == [((6, 7), (31, 32))]


def test_a_forwarded_save_sends_each_block_on_once_it_is_final() -> None:
    """Across nodes, chunked: a block goes on to the DE slots only in the step that
    completes it (a partial block is written again later), the last one with the prompt."""
    forward = BlockForward(1, (40, 41, 42), "boot:7")
    save = BlockSave(0, (30, 31, 32), 0, 7, forward)
    assert BlockSave.from_dict(save.to_dict()) == save
    plan = StepPlanner(BS)
    assert plan.matched_tokens("r", TransferParams(None, save), list(range(10)), 10, 0) == 0
    plan.allocated("r", 0)
    first = plan.step([("r", [5, 6], 0, 6)], [])  # block 0 full, block 1 half
    ((job,),) = [first.saves]
    assert job.slots == (30, 31) and job.forward is not None
    assert (job.forward.node, job.forward.slots, job.forward.job) == (1, (40,), "boot:7")
    second = plan.step([], [("r", [7], False, 6, 4)])  # the rest: block 1 and partial 2
    ((job,),) = [second.saves]
    assert job.slots == (31, 32) and job.forward is not None and job.forward.slots == (41, 42)
    # a step that completes no block forwards nothing
    plan2 = StepPlanner(BS)
    plan2.matched_tokens("q", TransferParams(None, save), list(range(10)), 10, 0)
    plan2.allocated("q", 0)
    ((job,),) = [plan2.step([("q", [5], 0, 3)], []).saves]
    assert job.slots == (30,) and job.forward is None


def test_a_forward_must_pair_with_the_saved_slots() -> None:
    with pytest.raises(ValueError, match=r"forward\.slots has 1 slots for 2 saved blocks"):
        BlockSave(0, (1, 2), 0, 0, BlockForward(1, (3,), "j"))
    with pytest.raises(ValueError, match=r"forward\.job"):
        BlockSave.from_dict(
            {
                "node": 0,
                "slots": [1],
                "first_block": 0,
                "forward": {"node": 1, "slots": [2], "job": ""},
            }
        )


def test_decode_loads_everything_persists_new_prompt_blocks_then_generated_ones() -> None:
    """Prompt of 10 tokens, 1 block in the store: the decode persists block 1 from its slot,
    frees the slots of block 0 (stored) and block 2 (partial), then each filled block."""
    plan = StepPlanner(BS)
    tokens = list(range(10))
    params = TransferParams(BlockLoad(1, (40, 41, 42), 10), None, BlockPersist(1, 1, "ns"))
    assert plan.matched_tokens("r", params, tokens, 10, 0) == 9
    plan.allocated("r", 9)
    meta = plan.step([("r", [200, 201, 202], 9, 1)], [])
    assert [(j.block_ids, j.slots) for j in meta.loads] == [((200, 201, 202), (40, 41, 42))]
    (sp,) = meta.slot_persists
    keys = block_keys(tokens, BS, "ns")
    assert (sp.keys, sp.slots, sp.free) == ((keys[1],), (41,), (40, 42))
    assert not meta.block_persists
    tokens += [10, 11]  # two tokens generated: the step computing token 11 fills block 2
    assert plan.step([], [("r", None, False, 10, 1)]).is_empty()
    meta = plan.step([], [("r", None, False, 11, 1)])
    (bp,) = meta.block_persists
    assert (bp.block_ids, bp.keys) == ((202,), (block_keys(tokens, BS, "ns")[2],))
    plan.finished("r", None)
    assert not plan.knows("r")


def test_plain_requests_are_not_tracked() -> None:
    plan = StepPlanner(BS)
    assert plan.matched_tokens("r", None, [1, 2, 3], 3, 0) == 0
    assert not plan.knows("r")
    assert plan.step([("r", [1], 0, 3)], []).is_empty()


def test_hybrid_groups_load_only_what_each_window_still_sees() -> None:
    """Two KV cache groups (full attention, a sliding window of 6 tokens): a prefill with 12
    hit tokens loads every block of the full group and, of the window group, only the blocks
    the tokens from 12 on can see (tokens 7..): block 0 becomes vLLM's null block.
    Saves copy every group's blocks (a Full Block holds every layer)."""
    plan = StepPlanner(BS, windows=(0, 6))
    params = TransferParams(BlockLoad(0, (7, 8, 9), 12), BlockSave(1, (20, 21, 22, 23), 0))
    assert plan.matched_tokens("r", params, list(range(14)), 14, 0) == 12
    plan.allocated("r", 12)
    meta = plan.step([("r", ([100, 101, 102, 103], [200, 201, 202, 203]), 12, 2)], [])
    (load,) = meta.loads
    assert load.block_ids == (100, 101, 102) and load.group(1) == (0, 201, 202)
    (save,) = meta.saves
    assert save.group(0) == (100, 101, 102, 103) and save.group(1) == (200, 201, 202, 203)
    # blocks vLLM adds later extend every group
    later = plan.step([], [("r", ([104], [204]), False, 14, 4)])
    assert later.saves == [] or later.saves[0].group(1)[-1] == 204
    with pytest.raises(ValueError, match="windows"):
        StepPlanner(BS, windows=(-1,))


def test_generated_blocks_get_slots_and_a_job_each() -> None:
    """A decode's generated blocks are copied into slots the scheduler half allocates (so
    every worker of a TP / PP instance copies its part into the same ones), each persist a
    job of its own name; without slots to give, nothing is planned to persist."""

    class Owners:
        def __init__(self, free: int) -> None:
            self.free = free

        def alloc(self, node: int, n: int) -> list[int] | None:
            if n > self.free:
                return None
            self.free -= n
            return list(range(50, 50 + n))

        def claim(self, node: int, slots: object, lease: int) -> bool:
            return True

        def release(self, node: int, slots: object, lease: int) -> int:
            return 0

    plan = StepPlanner(BS, Owners(1), job_prefix="t")
    tokens = list(range(9))  # 2 full blocks and one token
    params = TransferParams(load=BlockLoad(1, (30, 31, 32), 9), persist=BlockPersist(1, 1, "ns"))
    assert plan.matched_tokens("d", params, tokens, 9, 0) == 8
    plan.allocated("d", 8)
    meta = plan.step([("d", [10, 11, 12], 8, 1)], [])
    (sp,) = meta.slot_persists  # block 1 is new to the store: from its slot; 0 and 2 freed
    assert sp.job == "t:1" and sp.slots == (31,) and sp.free == (30, 32)
    tokens += [9, 10, 11]  # vLLM's live token list grows as the decode generates
    meta = plan.step([], [("d", None, False, 9, 3)])
    (bp,) = meta.block_persists
    assert (bp.block_ids, bp.slots, bp.job) == ((12,), (50,), "t:2")
    assert bp.keys == tuple(block_keys(tokens, BS, "ns")[2:3])
    tokens += [12, 13, 14, 15]  # the buffer has no slot left: nothing to persist from
    assert plan.step([], [("d", [13], False, 12, 4)]).block_persists == []


def test_choices_of_one_request_load_the_same_slots() -> None:
    """vLLM's ``n`` > 1: its choices are requests of one set of params (``shares`` 3), which
    vLLM schedules one step after the other. Each loads the slots the first claimed (none
    recomputes: that would also draw its sampler's random numbers for a token thrown away);
    the slots are handed over once, after the last sharer loaded or left."""

    class Owners:
        def __init__(self) -> None:
            self.claims = 0

        def alloc(self, node: int, n: int) -> list[int] | None:
            return None

        def claim(self, node: int, slots: object, lease: int) -> bool:
            self.claims += 1
            return self.claims == 1  # a lease is claimed once

        def release(self, node: int, slots: object, lease: int) -> int:
            return 0

    owners = Owners()
    plan = StepPlanner(BS, owners)
    tokens = list(range(9))
    load = BlockLoad(1, (30, 31, 32), 9, lease=7, shares=3)
    params = TransferParams(load=load, persist=BlockPersist(1, 0, "ns"))
    assert TransferParams.from_request({"dualpath": params.to_dict()}) == params
    steps = []
    for i, rid in enumerate(("0_r", "1_r")):
        assert plan.matched_tokens(rid, params, tokens, 9, 0) == 8
        plan.allocated(rid, 8)
        steps.append(plan.step([(rid, [10 * i, 10 * i + 1, 10 * i + 2], 8, 1)], []))
    assert [(j.request_id, j.slots) for s in steps for j in s.loads] == [
        ("0_r", (30, 31, 32)),
        ("1_r", (30, 31, 32)),
    ]
    assert owners.claims == 1 and not any(s.slot_persists or s.lost for s in steps)
    plan.finished("2_r", params)  # the third choice left before vLLM scheduled it
    (sp,) = plan.step([], []).slot_persists  # now the slots go: once
    assert sp.request_id == "0_r" and sp.slots == (30, 31) and sp.free == (32,)
    assert plan.step([], []).is_empty()


class _Pins:
    """``SlotOwners`` that records pins: leases 1 and 2 hold every slot."""

    def __init__(self) -> None:
        self.pinned: dict[tuple[int, int], int] = {}  # (node, slot) → lease

    def alloc(self, node: int, n: int) -> list[int] | None:
        return None

    def claim(self, node: int, slots: object, lease: int) -> bool:
        return True

    def release(self, node: int, slots: object, lease: int) -> int:
        return 0

    def pin(self, node: int, slots: tuple[int, ...], lease: int) -> bool:
        if lease not in (1, 2):
            return False
        self.pinned.update({(node, s): lease for s in slots})
        return True

    def unpin(self, node: int, slots: tuple[int, ...]) -> int:
        return sum(self.pinned.pop((node, s), None) is not None for s in slots)


def _prefill(lease: int) -> TransferParams:
    return TransferParams(BlockLoad(0, (7, 8), 8, lease), BlockSave(1, (5, 6, 9), 0, lease))


def test_a_prefill_pins_its_slots_until_the_steps_before_it_left_ran() -> None:
    toks = list(range(10))
    for in_flight in (1, 2):
        owners = _Pins()
        plan = StepPlanner(BS, owners, steps_in_flight=in_flight)  # type: ignore[arg-type]
        assert plan.matched_tokens("p", _prefill(1), toks, 10, 0) == 8
        plan.allocated("p", 8)
        meta = plan.step([("p", [1, 2, 3], 0, 2)], [])
        assert meta.loads and meta.saves and not meta.lost
        assert set(owners.pinned) == {(0, 7), (0, 8), (1, 5), (1, 6), (1, 9)}
        plan.finished("p", None)  # aborted: the step above may still be running
        if in_flight == 1:  # one step at a time: it has run
            assert owners.pinned == {} and plan.num_pinning == 0
            continue
        assert len(owners.pinned) == 5 and plan.num_pinning == 1
        plan.step([], [])  # one more step planned: the first may still run beside it
        assert len(owners.pinned) == 5
        plan.step([], [])  # two more: vLLM runs at most two at once, so it ran
        assert owners.pinned == {} and plan.num_pinning == 0
        # or its output came back first
        assert plan.matched_tokens("q", _prefill(2), toks, 10, 0) == 8
        plan.allocated("q", 8)
        plan.step([("q", [1, 2, 3], 0, 2)], [])
        plan.finished("q", None)
        assert len(owners.pinned) == 5
        for _ in range(3):  # the outputs of the 3 steps before "q"'s
            plan.step_done()
        assert len(owners.pinned) == 5
        plan.step_done()  # and of "q"'s own
        assert owners.pinned == {}
    with pytest.raises(ValueError, match="steps_in_flight=0"):
        StepPlanner(BS, steps_in_flight=0)


def test_a_prefill_whose_lease_is_gone_pins_nothing_loads_nothing_saves_nothing() -> None:
    owners = _Pins()
    plan = StepPlanner(BS, owners)  # type: ignore[arg-type]
    toks = list(range(10))
    plan.matched_tokens("p", _prefill(3), toks, 10, 0)  # lease 3: the router let it go
    plan.allocated("p", 8)
    meta = plan.step([("p", [1, 2, 3], 0, 2)], [])
    assert meta.lost and not meta.loads and not meta.saves and owners.pinned == {}
    meta = plan.step([], [("p", None, False, 8, 2)])
    assert not meta.saves
