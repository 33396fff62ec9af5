"""Scheduler-side bookkeeping: one request (turn) in flight, one agent, one run's result."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dualpath.ledger import Turn
from dualpath.metrics import TurnRecord
from dualpath.runtime.decoding import TokenLogprob
from dualpath.runtime.gputime import GpuUse
from dualpath.runtime.sampling import SamplingParams

if TYPE_CHECKING:
    from dualpath.runtime.scheduler import Scheduler


class Req(Turn):
    """One submitted turn as the scheduler process carries it out: the ledger's ``Turn``
    (ids, sizes, phase, decision, timeline) plus the token ids, block keys, buffer slots and
    what the processes reported. ``hit_tokens`` is the store's hit at submission, then the
    tokens whose blocks were read and verified (``cached``)."""

    __slots__ = (
        "cached",
        "cancelled",
        "de_slots",
        "first_token",
        "generated",
        "in_pass",
        "keys",
        "kv_tokens",
        "logprobs",
        "namespace",
        "pe_slots",
        "read_node",
        "reading",
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
        self.reading = False  # its storage read is out (not yet reported back)
        self.cached = 0  # hit tokens whose blocks were read and verified
        self.kv_tokens = 0  # tokens with KV for the next chunk (hits, then earlier chunks)
        self.in_pass = False  # a chunk of it is in a PE forward pass right now
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
        self.cancelled = False  # its client is gone: abort as soon as its phase allows

    def stamp_done(self, second_token_s: float, finish_s: float) -> None:
        """Stamp the DE's second-token and finish times (read on its clock after the first
        token): one output token has no second token (the record requires second == first)."""
        one = self.output_tokens == 1
        self.second_token_s = self.first_token_s if one else max(second_token_s, self.first_token_s)
        self.finish_s = max(finish_s, self.second_token_s)


@dataclass(slots=True)
class AgentState:
    """An agent's script (token ids appended per turn, tokens to generate per turn) and its
    progress: the context grows by each turn's append and real greedy output."""

    agent_id: int
    appends: tuple[tuple[int, ...], ...]
    outputs: tuple[int, ...]
    context: tuple[int, ...] = ()
    turn: int = 0
    generated: list[tuple[int, ...]] = field(default_factory=list)
    tenant: str = ""  # salts its blocks' hash chain ("" = ``RuntimeOptions.tenant``)

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


def _union_s(windows: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(windows):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


@dataclass(frozen=True, slots=True)
class RunResult:
    """Records (for ``dualpath.metrics.summarize``), outputs, bytes per path, SNIC use."""

    records: tuple[TurnRecord, ...]
    outputs: dict[int, tuple[tuple[int, ...], ...]]  # agent → generated tokens per turn
    bytes_by_path: dict[str, int]
    snic_busy_utilisation: float  # bytes read / (SNIC rate × time each SNIC had reads); NaN: n/a
    snic_aggregate_utilisation: float  # bytes read / (all SNICs' rate × time any read ran)
    requeued: int
    alloc_stalls: int
    wall_s: float
    forward_passes: int = 0  # PE forward passes
    forward_chunks: int = 0  # request chunks over all passes (mean batch = chunks / passes)
    chunked: int = 0  # chunks that were not their request's last (chunked prefill)
    max_pass_tokens: int = 0  # most cached + new tokens one pass held
    pass_new_tokens: int = 0  # tokens computed by all PE passes
    pass_busy_s: float = 0.0  # Σ PE pass durations (engine-measured)
    # per engine name, with ``gpu_time="emulated"``: passes / steps, overruns, Σ times
    gpu_use: dict[str, GpuUse] = field(default_factory=dict)

    @property
    def mean_batch(self) -> float:
        return self.forward_chunks / self.forward_passes if self.forward_passes else 0.0

    @classmethod
    def build(cls, sched: Scheduler, start_s: float, end_s: float) -> RunResult:
        c = sched.counters
        rate = sched.env.config.hardware.snic_total_bytes_per_s
        read = c.pe_read_bytes + c.de_read_bytes
        busy = sum(_union_s(w) for w in c.read_windows.values())
        span = _union_s([x for w in c.read_windows.values() for x in w])
        nodes = sched.topo.num_nodes
        paced = sched.env.options.paced_kv  # the Oracle's reads take no SNIC time: no figure
        nan = float("nan")
        paths: dict[str, Any] = {
            "pe_read": c.pe_read_bytes, "de_read": c.de_read_bytes,
            "layer_blocks_to_pe": c.layer_in_bytes, "pe_to_de_buffer": c.pd_bytes,
            "de_buffer_to_hbm": c.h2d_bytes,
            "persisted": c.persisted_blocks * sched.env.layout.full_block_bytes,
        }  # fmt: skip
        return cls(
            records=tuple(sorted(sched.records, key=lambda r: r.request_id)),
            outputs={a: tuple(s.generated) for a, s in sorted(sched.agents.items())},
            bytes_by_path=paths,
            snic_busy_utilisation=read / (rate * busy) if busy > 0 and paced else nan,
            snic_aggregate_utilisation=read / (rate * nodes * span) if span > 0 and paced else nan,
            requeued=c.requeued,
            alloc_stalls=c.alloc_stalls,
            wall_s=end_s - start_s,
            forward_passes=c.passes,
            forward_chunks=c.pass_chunks,
            chunked=c.chunked,
            max_pass_tokens=c.max_pass_tokens,
            pass_new_tokens=c.pass_new_tokens,
            pass_busy_s=c.pass_busy_s,
            gpu_use={sched.topo.engine_name(e): u for e, u in sorted(c.gpu.items())},
        )
