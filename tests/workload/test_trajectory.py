"""turn_requests on hand-built trajectories: prompt, hit (design §3) and output per turn."""

from __future__ import annotations

import pytest

from dualpath.workload import Trajectory, TrajectoryTurn, TurnSpec, persisted_tokens, turn_requests


def test_turn_requests_hand_built() -> None:
    traj = Trajectory(
        3,
        (
            TrajectoryTurn(100, 10),
            TrajectoryTurn(20, 5),
            TrajectoryTurn(64, 1),
            TrajectoryTurn(1, 7),
        ),
    )
    specs = turn_requests(traj, block_tokens=64)
    # turn 0: prompt 100, nothing stored yet
    # turn 1: prompt 110 + 20 = 130; stored after turn 0: floor((110 - 1) / 64) * 64 = 64
    # turn 2: prompt 135 + 64 = 199; stored: floor((135 - 1) / 64) * 64 = 128
    # turn 3: prompt 200 + 1 = 201; stored: floor((200 - 1) / 64) * 64 = 192
    assert specs == [
        TurnSpec(0, 100, 0, 10),
        TurnSpec(1, 130, 64, 5),
        TurnSpec(2, 199, 128, 1),
        TurnSpec(3, 201, 192, 7),
    ]
    assert [s.new_tokens for s in specs] == [100, 66, 71, 9]


def test_exact_block_boundary_keeps_last_token_uncached() -> None:
    # after turn 0 the context is exactly 128 tokens, but the last generated token has no KV
    specs = turn_requests(
        Trajectory(0, (TrajectoryTurn(120, 8), TrajectoryTurn(10, 2))), block_tokens=64
    )
    assert specs[1].hit_tokens == 64
    specs = turn_requests(
        Trajectory(0, (TrajectoryTurn(120, 9), TrajectoryTurn(10, 2))), block_tokens=64
    )
    assert specs[1].hit_tokens == 128


def test_block_size_one_hits_everything_but_the_last_token() -> None:
    specs = turn_requests(
        Trajectory(0, (TrajectoryTurn(50, 5), TrajectoryTurn(7, 3))), block_tokens=1
    )
    assert specs[1].prompt_tokens == 62
    assert specs[1].hit_tokens == 54


def test_persisted_tokens() -> None:
    assert persisted_tokens(1, 64) == 0
    assert persisted_tokens(65, 64) == 64
    assert persisted_tokens(64, 64) == 0


def test_trajectory_totals() -> None:
    traj = Trajectory(0, (TrajectoryTurn(100, 10), TrajectoryTurn(20, 5)))
    assert traj.total_tokens == 135
    assert traj.num_turns == 2


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: TrajectoryTurn(0, 5), "append_tokens"),
        (lambda: TrajectoryTurn(5, 0), "gen_tokens"),
        (lambda: Trajectory(-1, (TrajectoryTurn(1, 1),)), "agent_id"),
        (lambda: Trajectory(0, ()), "turns"),
        (lambda: TurnSpec(0, 10, 10, 1), "hit_tokens"),
        (lambda: turn_requests(Trajectory(0, (TrajectoryTurn(1, 1),)), 0), "block_tokens"),
    ],
)
def test_invalid_values_name_the_field(build: object, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        build()  # type: ignore[operator]
