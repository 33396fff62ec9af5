"""Control messages between the scheduler, engines and storage workers (multiprocessing queues).

They carry ids, token ids, buffer slot numbers and timestamps; KV bytes never travel here
(they move through a ``KVTransport`` into buffer slots named by these messages).
"""

from __future__ import annotations

from dataclasses import dataclass

from dualpath.runtime.transport.base import RegionHandle


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
    """``num_ok`` leading blocks verified; the rest missing or corrupt (to recompute)."""

    request_id: int
    node_id: int
    num_ok: int
    start_s: float
    done_s: float


@dataclass(frozen=True, slots=True)
class PersistMsg:
    """Storage worker: write the Full Block in ``slot`` under ``key``, then free the slot."""

    key: str
    slot: int


@dataclass(frozen=True, slots=True)
class PersistedMsg:
    """The storage worker wrote (or already had) the block ``key``: it is durable (fsynced).
    ``ok=False``: persisting failed after retries (e.g. a full disk); the block is not cached."""

    key: str
    ok: bool = True


@dataclass(frozen=True, slots=True)
class PrefillMsg:
    """PE: prefill ``tokens[cached:]`` after the ``cached`` prefix whose Full Blocks sit in
    ``src_slots`` of node ``src_node``'s buffer (PE or DE buffer); send the KV of tokens
    ``send_from..`` (0 on the PE read path, ``cached`` on the DE path) to ``de_slots`` of node
    ``de_node``'s DE buffer. ``layerwise``: load/compute/send one layer at a time."""

    request_id: int
    tokens: tuple[int, ...]
    cached: int
    src_node: int
    src_slots: tuple[int, ...]
    de_node: int
    de_slots: tuple[int, ...]
    send_from: int
    layerwise: bool


@dataclass(frozen=True, slots=True)
class PrefillDoneMsg:
    request_id: int
    engine_id: int
    first_token: int
    start_s: float
    done_s: float
    bytes_in: int  # KV Layer Blocks loaded into the PE
    bytes_out: int  # KV sent to the DE buffer


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


@dataclass(frozen=True, slots=True)
class LoadedMsg:
    """The DE has the request's prompt KV in HBM: its DE buffer slots can be freed."""

    request_id: int


@dataclass(frozen=True, slots=True)
class DecodeDoneMsg:
    request_id: int
    engine_id: int
    output: tuple[int, ...]  # all generated tokens, first included
    second_token_s: float
    finish_s: float
    bytes_in: int
    persisted_keys: tuple[str, ...]  # blocks handed to the storage worker for this turn
