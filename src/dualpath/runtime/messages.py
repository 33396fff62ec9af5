"""Control messages between the scheduler, engines and storage workers (multiprocessing queues).

They carry ids, token ids, buffer slot numbers and timestamps; KV bytes never travel here
(they move through a ``KVTransport`` into buffer slots named by these messages).
"""

from __future__ import annotations

from dataclasses import dataclass

from dualpath.kv.transport.base import RegionHandle
from dualpath.runtime.sampling import SamplingParams
from dualpath.tokens import TokenLogprob


@dataclass(frozen=True, slots=True)
class RegionsMsg:
    """Engines: the node buffers' transport regions, as the storage workers announced them
    (engines start in parallel with the storage workers, so they learn these after spawn)."""

    regions: tuple[RegionHandle, ...]


@dataclass(frozen=True, slots=True)
class ReadyMsg:
    """A process finished starting (``who`` = its name). A storage worker also announces its
    node buffer as a transport region (``region``), which engines then address."""

    who: str
    pid: int
    region: RegionHandle | None = None


@dataclass(frozen=True, slots=True)
class ErrorMsg:
    """A process hit an error it cannot handle; the scheduler shuts the run down."""

    who: str
    text: str


@dataclass(frozen=True, slots=True)
class StopMsg:
    pass


@dataclass(frozen=True, slots=True)
class ReadMsg:
    """Storage worker: read Full Blocks ``keys`` into slots of this node's buffer."""

    request_id: int
    keys: tuple[str, ...]
    slots: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ReadDoneMsg:
    """``num_ok`` leading blocks verified; the rest missing or corrupt (to recompute).
    ``num_from_tier`` of them came from the node's DRAM tier (``dram-tier``), not storage."""

    request_id: int
    node_id: int
    num_ok: int
    start_s: float
    done_s: float
    num_from_tier: int = 0


@dataclass(frozen=True, slots=True)
class PersistMsg:
    """Write the Full Block in slot ``slot`` of node ``node``'s buffer under ``key``. A DE
    sends it to the scheduler, which hands it to the node's current storage worker and frees
    the slot on its ``PersistedMsg`` (or hands it to the next worker, if this one died)."""

    key: str
    slot: int
    node: int = 0
    request_id: int = -1  # the turn whose block it is, and the block's index in its context
    block: int = -1


@dataclass(frozen=True, slots=True)
class TierPutMsg:
    """Storage worker (``dram-tier``): keep a copy of block ``key``, computed by this node's
    PE and durable now, in the node's DRAM tier. The PE had the bytes in HBM (a D2H copy on
    this node, no storage traffic); the worker takes them from the store, charged to this
    node's DRAM only."""

    key: str


@dataclass(frozen=True, slots=True)
class PersistedMsg:
    """The storage worker wrote (or already had) the block ``key``: it is durable (fsynced).
    ``ok=False``: persisting failed after retries (e.g. a full disk); the block is not cached."""

    key: str
    ok: bool = True
    node: int = 0  # the write's node and slot (``PersistMsg``): the scheduler frees it
    slot: int = -1


@dataclass(frozen=True, slots=True)
class ChunkWork:
    """One request's chunk in a PE forward pass: compute ``tokens[cached:cached+new]`` after
    the ``cached`` prefix. Prefix KV of tokens ``< hit`` sits in ``hit_slots`` of node
    ``hit_node``'s buffer (PE or DE buffer: the storage hits); of tokens ``hit..cached`` (earlier
    chunks) in ``de_slots``. The KV of tokens ``send_from..cached+new`` goes to ``de_slots`` of
    node ``de_node``'s DE buffer (``send_from`` is 0 on the PE read path's first chunk, so the
    hit KV reaches the DE too, else ``cached``)."""

    request_id: int
    tokens: tuple[int, ...]  # tokens[: cached + new]
    cached: int
    new: int
    hit: int
    hit_node: int
    hit_slots: tuple[int, ...]
    de_node: int
    de_slots: tuple[int, ...]
    send_from: int
    is_last: bool
    sampling: SamplingParams | None = None  # None: greedy (the first token, on the last chunk)


@dataclass(frozen=True, slots=True)
class ExchangePlan:
    """One group pass's exchange, the same for every participant: ``pass_id`` (unique per
    group pass), the participating PEs in group order, their exchange regions, their pids and
    how many new tokens each computes in this pass."""

    pass_id: int
    engines: tuple[int, ...]
    regions: tuple[RegionHandle, ...]
    pids: tuple[int, ...]
    new_tokens: tuple[int, ...]

    def __post_init__(self) -> None:
        n = len(self.engines)
        if not (len(self.regions) == len(self.pids) == len(self.new_tokens) == n):
            raise ValueError(f"ExchangePlan: {n} engines need as many regions, pids, token counts")


@dataclass(frozen=True, slots=True)
class ForwardMsg:
    """PE: run one forward pass over ``chunks`` (the policy's plan for this PE).
    ``layerwise``: load/compute/send one layer at a time (design §8), else every layer's KV of
    the batch is resident before the pass computes."""

    chunks: tuple[ChunkWork, ...]
    layerwise: bool
    exchange: ExchangePlan | None = None  # the group's per-layer hidden-state all-gather


@dataclass(frozen=True, slots=True)
class ForwardDoneMsg:
    """A PE finished a pass: the first token of each request whose last chunk ran
    (``(request_id, token)``), bytes loaded / sent, and its HBM pool's free pages."""

    engine_id: int
    request_ids: tuple[int, ...]
    first_tokens: tuple[tuple[int, int], ...]
    start_s: float
    done_s: float
    bytes_in: int
    bytes_out: int
    free_pages: int
    first_logprobs: tuple[tuple[int, TokenLogprob], ...] = ()  # requests that asked for them
    emulated_s: float = 0.0  # the pass's emulated GPU time (0: ``gpu_time="host"``)
    host_s: float = 0.0  # the host's compute time of the pass (waits for loads excluded)


@dataclass(frozen=True, slots=True)
class DecodeMsg:
    """DE: load the prompt KV from ``de_slots`` of its node's buffer (then free them), decode
    to ``output_tokens`` tokens after ``first_token`` and persist every block that fills from
    block ``stored_blocks`` on."""

    request_id: int
    tokens: tuple[int, ...]
    first_token: int
    output_tokens: int
    de_slots: tuple[int, ...]
    stored_blocks: int
    sampling: SamplingParams | None = None  # None: greedy, to ``output_tokens``
    namespace: str = ""  # the hash chain of its blocks' keys ("" = the run's default tenant)
    # d2p (docs/peers.md): keep the turn's pages when it ends, for its agent's next turn to
    # pull (``HeldCopyMsg``) or the scheduler to release (``ReleaseHeldMsg``); and the
    # prompt's first blocks this DE held for it (in HBM already: no H2D charged for them)
    hold: bool = False
    resident_blocks: int = 0


@dataclass(frozen=True, slots=True)
class HeldCopyMsg:
    """DE (d2p): copy the first ``len(slots)`` blocks of the pages held for turn ``held_id``
    into ``slots`` of node ``node``'s buffer (where the PE loads them, as a DE-side hit), then
    release the hold; answer ``HeldCopiedMsg`` for turn ``request_id``."""

    request_id: int
    held_id: int
    node: int
    slots: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class HeldCopiedMsg:
    """The DE copied ``num_blocks`` held blocks for turn ``request_id`` (0: it held none,
    e.g. after a restart); ``free_pages``: its pool after releasing the hold."""

    request_id: int
    engine_id: int
    num_blocks: int
    free_pages: int


@dataclass(frozen=True, slots=True)
class ReleaseHeldMsg:
    """DE (d2p): the hold of turn ``held_id`` ended (its TTL, or its agent is gone): free its
    pages; answer ``HeldCopiedMsg`` with ``request_id`` -1 (the pool's new size)."""

    held_id: int


@dataclass(frozen=True, slots=True)
class LoadedMsg:
    """The DE has the request's prompt KV in HBM: its DE buffer slots can be freed."""

    request_id: int
    engine_id: int
    free_pages: int  # the DE's HBM pool after admitting it


@dataclass(frozen=True, slots=True)
class DecodeDoneMsg:
    request_id: int
    engine_id: int
    output: tuple[int, ...]  # all generated tokens, first included
    second_token_s: float
    finish_s: float
    bytes_in: int
    persisted_keys: tuple[str, ...]  # blocks handed to the storage worker for this turn
    free_pages: int  # the DE's HBM pool after releasing it


@dataclass(frozen=True, slots=True)
class TokensMsg:
    """A DE's decode step: the token each request got (``(request_id, token)``), so that the
    scheduler counts the tokens generated (a DE's tok_e) and a server can stream them."""

    engine_id: int
    tokens: tuple[tuple[int, int], ...]
    logprobs: tuple[tuple[int, TokenLogprob], ...] = ()  # requests that asked for them
    emulated_s: float = 0.0  # the step's emulated GPU time (0: ``gpu_time="host"``)
    host_s: float = 0.0  # the host's compute time of the step


@dataclass(frozen=True, slots=True)
class WakeMsg:
    """Scheduler, from its own process: a thread handed it work (a submission, a cancel), so
    its loop stops waiting for the processes' messages and takes it now."""


@dataclass(frozen=True, slots=True)
class CancelMsg:
    """DE: drop the request (its client is gone). A waiting one answers ``LoadedMsg`` (its DE
    buffer slots are free to reuse); a running one ends at the next step (``DecodeDoneMsg``)."""

    request_id: int
