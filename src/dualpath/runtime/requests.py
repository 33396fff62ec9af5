"""Scheduler-side bookkeeping: one request (turn) in flight, one agent (the run's result:
``runtime.result``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dualpath.ledger import Turn
from dualpath.runtime.sampling import SamplingParams
from dualpath.tokens import TokenLogprob
from dualpath.workload.scripts import AgentScript


class Req(Turn):
    """One submitted turn as the scheduler process carries it out: the ledger's ``Turn``
    (ids, sizes, lifecycle state and progress, decision, timeline) plus the token ids, block
    keys, buffer slots and what the processes reported. ``hit_tokens`` is the store's hit at submission, then the
    tokens whose blocks were read and verified (``cached``)."""

    __slots__ = (
        "cached",
        "de_slots",
        "first_token",
        "generated",
        "keys",
        "logprobs",
        "namespace",
        "pe_slots",
        "read_node",
        "resumed",
        "sampling",
        "streamed",
        "tokens",
    )

    def __init__(
        self,
        request_id: int,
        agent_id: int,
        turn_index: int,
        tokens: tuple[int, ...],
        output_tokens: int,
        keys: tuple[str, ...],
        hit_tokens: int,
        arrival_s: float,
        sampling: SamplingParams | None = None,
        namespace: str = "",
    ) -> None:
        super().__init__(
            request_id, agent_id, turn_index, len(tokens), hit_tokens, output_tokens, arrival_s
        )
        self.tokens = tokens
        self.keys = keys
        self.namespace = namespace  # the hash chain's: its tenant's
        self.sampling = sampling  # None: greedy
        self.read_node = -1  # the node its hit blocks are read on (-1: nothing to read)
        self.cached = 0  # hit tokens whose blocks were read and verified
        self.pe_slots: list[int] = []
        self.de_slots: list[int] = []
        self.first_token = -1
        self.generated = 0  # tokens its DE reported generated (from admission, token 1 on)
        self.streamed: list[int] = []  # tokens reported so far (servers)
        # output tokens of this turn that an earlier incarnation delivered before its engine
        # died: this request continues after them (its prompt ends with them)
        self.resumed: tuple[int, ...] = ()
        # the log-probabilities of the turn's output so far (resumed tokens first), for a
        # client that asked for them (``sampling.logprobs``)
        self.logprobs: list[TokenLogprob] = []

    def stamp_done(self, second_token_s: float, finish_s: float) -> None:
        """Stamp the DE's second-token and finish times (read on its clock after the first
        token): one output token has no second token (the record requires second == first)."""
        one = self.output_tokens == 1
        self.second_token_s = self.first_token_s if one else max(second_token_s, self.first_token_s)
        self.finish_s = max(finish_s, self.second_token_s)


@dataclass(slots=True)
class AgentState:
    """An agent's script (token ids appended per turn, tokens to generate per turn: a
    ``workload.scripts.AgentScript``) and its progress: the context grows by each turn's
    append and real greedy output."""

    agent_id: int
    appends: tuple[tuple[int, ...], ...]
    outputs: tuple[int, ...]
    context: tuple[int, ...] = ()
    turn: int = 0
    generated: list[tuple[int, ...]] = field(default_factory=list)
    tenant: str = ""  # salts its blocks' hash chain ("" = ``RuntimeOptions.tenant``)

    @classmethod
    def from_script(cls, script: AgentScript) -> AgentState:
        return cls(script.agent_id, script.appends, script.outputs)

    @property
    def finished(self) -> bool:
        return self.turn >= len(self.appends)

    def next_turn(self) -> tuple[tuple[int, ...], int] | None:
        if self.finished:
            return None
        return self.appends[self.turn], self.outputs[self.turn]

    def finish_turn(self, prompt: tuple[int, ...], output: tuple[int, ...]) -> None:
        self.context = (*prompt, *output)
        self.generated.append(output)
        self.turn += 1
