"""The agent driver: each agent's next turn is submitted when its previous turn is finished
(zero think time, design §9) — at once, or held until the blocks that turn persisted are
durable, so the next turn's hits are what the previous one persisted. Both shells use it.

It decides *when*; the shell builds and submits the turn (``submit``), and the agent object
says whether it has a turn left (``finished``). Pure: no clock, the shell passes ``now``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Generic, Protocol, TypeVar


class Agent(Protocol):
    """``finished``: no turn is left to submit."""

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
        self._waiting: dict[Hashable, list[int]] = {}  # key → agents whose turn waits on it

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
        """``agent_id``'s previous turn is finished (or it starts): submit its next turn,
        arrived at ``now``, or hold it until every key of ``pending`` is ``durable`` (the hold
        delays its submission, not its arrival: the wait counts as queueing)."""
        agent = self.agents[agent_id]
        if agent.finished:
            return
        keys = set(pending)
        if not keys:
            self._submit(agent, now)
            return
        self._held[agent_id] = (keys, now)
        for key in keys:
            self._waiting.setdefault(key, []).append(agent_id)

    def durable(self, key: Hashable) -> None:
        """``key``'s write was acknowledged (written, or dropped and so never cached): submit
        the turns that waited only on it, in agent id order."""
        for agent_id in sorted(self._waiting.pop(key, ())):
            keys, arrival_s = self._held[agent_id]
            keys.discard(key)
            if not keys:
                del self._held[agent_id]
                self._submit(self.agents[agent_id], arrival_s)

    def release_all(self) -> None:
        """Writes were lost and will never be acknowledged: submit every held turn now."""
        self._waiting.clear()
        for agent_id in sorted(self._held):
            _, arrival_s = self._held.pop(agent_id)
            agent = self.agents[agent_id]
            if not agent.finished:
                self._submit(agent, arrival_s)
