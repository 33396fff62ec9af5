"""``workload.scripts``: one synthesis for the runtime's token scripts and the load generator's
chat scripts (torch-free: the simulator's tests use them too)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dualpath.config import preset
from dualpath.workload.scripts import (
    AgentScript,
    agent_scripts,
    chat_scripts,
    small_trajectories,
)


def test_agent_scripts_are_seeded_and_in_vocab() -> None:
    cfg = preset("tiny-1p1d")
    wl = replace(cfg.workload, num_agents=3)
    trajs = small_trajectories(wl, 64, num_turns=4, token_scale=0.1, max_gen_tokens=5)
    assert all(len(t.turns) == 4 and max(x.gen_tokens for x in t.turns) <= 5 for t in trajs)
    a = agent_scripts(trajs, 1024, seed=1)
    b = agent_scripts(trajs, 1024, seed=1)
    assert [x.appends for x in a] == [x.appends for x in b]
    assert a[0].appends != agent_scripts(trajs, 1024, seed=2)[0].appends
    assert all(0 <= tok < 1024 for ag in a for ap in ag.appends for tok in ap)
    assert [len(ap) for ap in a[0].appends] == [t.append_tokens for t in trajs[0].turns]


def test_chat_scripts_follow_the_same_trajectories_as_agent_scripts() -> None:
    """The load generator's agents are the runtime's, in words: same turns, same lengths."""
    wl = replace(preset("tiny-1p1d").workload, num_agents=4, num_base_trajectories=4, seed=2)
    trajs = small_trajectories(wl, 64, num_turns=3, token_scale=0.05, max_gen_tokens=8)
    chats = chat_scripts(4, 3, token_scale=0.05, max_gen_tokens=8, block_tokens=64, seed=2)
    assert [c.session_id for c in chats] == [f"agent-{t.agent_id}" for t in trajs]
    for chat, traj in zip(chats, trajs, strict=True):
        assert [(t.append_words, t.max_tokens) for t in chat.turns] == [
            (t.append_tokens, t.gen_tokens) for t in traj.turns
        ]


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda wl: small_trajectories(wl, 64, num_turns=0), "num_turns"),
        (lambda wl: small_trajectories(wl, 64, 2, token_scale=0), "token_scale"),
        (lambda wl: small_trajectories(wl, 64, 2, max_gen_tokens=0), "max_gen_tokens"),
        (lambda wl: chat_scripts(0, 2, 0.1, 4), "--agents"),
        (lambda wl: chat_scripts(2, 2, 1.5, 4), "--token-scale"),
        (lambda wl: AgentScript(0, ((1,),), (1, 2)), "outputs"),
    ],
)
def test_bad_script_input_is_a_one_line_error(call: object, match: str) -> None:
    wl = preset("tiny-1p1d").workload
    with pytest.raises(ValueError, match=match) as err:
        call(wl)  # type: ignore[operator]
    assert "\n" not in str(err.value)
