"""The agent driver: each agent's next turn is submitted when its previous turn is finished
(zero think time, SPEC §9) — at once, or held until the blocks that turn persisted are
durable, so the next turn's hits are what the previous one persisted. Both shells use it.

It decides *when*; the shell builds and submits the turn (``submit``), and the agent object
says whether it has a turn left (``finished``). Pure: no clock, the shell passes ``now``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Generic, Protocol, TypeVar


class Agent(Protocol):
    @property
    def agent_id(self) -> int: ...
    @property
    def finished(self) -> bool: ...


A = TypeVar("A", bound=Agent)


class AgentDriver(Generic[A]):
    """``submit(agent, arrival_s)`` builds and submits ``agent``'s next turn. Held agents are
    released in agent id order."""

    def __init__(self, submit: Callable[[A, float], object]) -> None:
        self._submit = submit
        self.agents: dict[int, A] = {}
        self._held: dict[int, tuple[set[Hashable], float]] = {}  # agent → (keys, arrival_s)

    def add(self, agent: A) -> None:
        """Track ``agent`` (replacing one of the same id)."""
        self.agents[agent.agent_id] = agent

    def get(self, agent_id: int) -> A | None:
        return self.agents.get(agent_id)

    def __getitem__(self, agent_id: int) -> A:
        return self.agents[agent_id]

    def __contains__(self, agent_id: int) -> bool:
        return agent_id in self.agents

    def __iter__(self) -> Iterator[A]:
        return iter(self.agents.values())

    def forget(self, agent_id: int) -> None:
        """Drop a finished agent that no turn waits on (a server's long run)."""
        agent = self.agents.get(agent_id)
        if agent is not None and agent.finished and agent_id not in self._held:
            del self.agents[agent_id]

    @property
    def busy(self) -> bool:
        """Some agent has a turn left (submitted or not)."""
        return any(not a.finished for a in self.agents.values())

    def holds(self, agent_id: int) -> bool:
        return agent_id in self._held

    def next_turn(self, agent_id: int, now: float, pending: Iterable[Hashable] = ()) -> None:
        """``agent_id``'s previous turn is finished at ``now`` (or it starts): submit its next
        turn, or hold it until every key of ``pending`` is ``durable`` (the next turn then
        arrives at ``now`` all the same: the hold delays its submission, not its arrival)."""
        agent = self.agents[agent_id]
        if agent.finished:
            return
        keys = set(pending)
        if keys:
            self._held[agent_id] = (keys, now)
        else:
            self._submit(agent, now)

    def durable(self, key: Hashable) -> None:
        """``key``'s write was acknowledged: submit the turns that waited only on it."""
        for agent_id in sorted(self._held):
            keys, arrival_s = self._held[agent_id]
            keys.discard(key)
            if not keys:
                del self._held[agent_id]
                self._submit(self.agents[agent_id], arrival_s)

    def release_all(self) -> None:
        """Writes were lost and will never be acknowledged: submit every held turn now."""
        for agent_id in sorted(self._held):
            _, arrival_s = self._held.pop(agent_id)
            agent = self.agents[agent_id]
            if not agent.finished:
                self._submit(agent, arrival_s)
