"""What the DualPath router tells a vLLM instance's connector about one request.

The router sends it inside vLLM's own per-request ``kv_transfer_params`` (the field vLLM's
disaggregated flow uses), under the key ``"dualpath"``; the connector's scheduler half reads it
from ``request.kv_transfer_params``. Plain data, no vLLM, no torch: the router builds it, the
connector parses it, tests check both sides.

- ``load``: blocks whose KV already sits in a node buffer (storage read done by the router's
  side-car, or the prefill's KV for a decode) to copy into the instance's paged KV before the
  tokens after them are computed. A prefill loads the hit tokens (from the PE buffer: PE read
  path; from the DE buffer over the compute network: DE read path); a decode loads the whole
  prompt from its DE buffer.
- ``save``: a prefill writes the KV of prompt blocks ``first_block`` on, layer by layer, into
  the DE buffer's slots ``slots`` (one slot per block; PE read path: every block, DE read path:
  only the blocks after the hits, which the DE buffer already holds). Across nodes it writes
  its own node's buffer, and each layer goes on to the DE buffer as it is saved
  (``forward``: the layerwise hand-over).
- ``store`` (``persist`` here): a decode persists the Full Blocks its generation fills (blocks ``first_block`` on)
  to the store, through its node's side-car, under the hash-chain namespace ``namespace``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

KEY = "dualpath"


def _ints(name: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list | tuple) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        raise ValueError(f"dualpath.{name}={value!r} is invalid: must be a list of integers >= 0")
    return tuple(value)


def _int(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"dualpath.{name}={value!r} is invalid: must be an integer >= 0")
    return value


@dataclass(frozen=True, slots=True)
class BlockLoad:
    """Copy ``num_tokens`` tokens of KV (``ceil(num_tokens / block)`` blocks) from node
    ``node``'s buffer slots ``slots`` into the request's first paged blocks.

    ``lease``: the owner tag the router allocated the slots under (0: anonymous). A decode's
    slots are handed over with its load: the instance claims them from that tag when it loads
    (``SlotBuffer.transfer``), and a request that ends before its load gives them back. A
    prefill's stay the router's; the instance pins them while it loads (``BlockSave``).

    ``shares``: the requests vLLM makes of it that load the same slots (``n`` choices: vLLM
    runs each as a request of its own, with these params); the slots are handed over once
    the last of them loaded or left."""

    node: int
    slots: tuple[int, ...]
    num_tokens: int
    lease: int = 0
    shares: int = 1

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "node": self.node,
            "slots": list(self.slots),
            "num_tokens": self.num_tokens,
            "lease": self.lease,
        }
        if self.shares != 1:
            out["shares"] = self.shares
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BlockLoad:
        lease = d.get("lease", 0)
        if not isinstance(lease, int) or isinstance(lease, bool) or lease < 0:
            raise ValueError(f"dualpath.load.lease={lease!r} is invalid: must be an integer >= 0")
        shares = d.get("shares", 1)
        if not isinstance(shares, int) or isinstance(shares, bool) or shares < 1:
            raise ValueError(f"dualpath.load.shares={shares!r} is invalid: must be an integer >= 1")
        return cls(
            _int("load.node", d.get("node")),
            _ints("load.slots", d.get("slots")),
            _int("load.num_tokens", d.get("num_tokens")),
            lease,
            shares,
        )


@dataclass(frozen=True, slots=True)
class BlockForward:
    """Across nodes: each saved layer of each block also goes to node ``node``'s buffer slot
    ``slots[i]`` (``slots`` pairs with ``BlockSave.slots``), pushed over the compute network
    by the saving node's side-car as soon as the layer is saved (layerwise hand-over), as
    the hand-over named ``job``; the router waits for the job, not for a push after the
    prefill."""

    node: int
    slots: tuple[int, ...]
    job: str

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "slots": list(self.slots), "job": self.job}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BlockForward:
        job = d.get("job")
        if not isinstance(job, str) or not job:
            raise ValueError(f"dualpath.save.forward.job={job!r} is invalid: must be a name")
        return cls(
            _int("save.forward.node", d.get("node")),
            _ints("save.forward.slots", d.get("slots")),
            job,
        )


@dataclass(frozen=True, slots=True)
class BlockSave:
    """Write prompt blocks ``first_block``, ``first_block + 1``, … into node ``node``'s buffer
    slots ``slots`` (``slots[i]`` holds block ``first_block + i``), each layer as it is computed.

    ``lease``: the owner tag the router allocated the slots under (0: none). The instance pins
    them under that lease while the request runs (``SlotBuffer.pin``), as it pins a prefill's
    load: given back by the router meanwhile, they are free only once the instance is done.
    ``forward``: where each saved layer goes on to, across nodes (``BlockForward``)."""

    node: int
    slots: tuple[int, ...]
    first_block: int
    lease: int = 0
    forward: BlockForward | None = None

    def __post_init__(self) -> None:
        if self.forward is not None and len(self.forward.slots) != len(self.slots):
            raise ValueError(
                f"dualpath.save.forward.slots has {len(self.forward.slots)} slots for "
                f"{len(self.slots)} saved blocks: must pair with save.slots"
            )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "node": self.node,
            "slots": list(self.slots),
            "first_block": self.first_block,
        }
        if self.lease:
            out["lease"] = self.lease
        if self.forward is not None:
            out["forward"] = self.forward.to_dict()
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BlockSave:
        forward = d.get("forward")
        if forward is not None and not isinstance(forward, dict):
            raise ValueError(f"dualpath.save.forward={forward!r} is invalid: must be an object")
        return cls(
            _int("save.node", d.get("node")),
            _ints("save.slots", d.get("slots")),
            _int("save.first_block", d.get("first_block")),
            _int("save.lease", d.get("lease", 0)),
            BlockForward.from_dict(forward) if forward else None,
        )


@dataclass(frozen=True, slots=True)
class BlockPersist:
    """Persist the Full Blocks from ``first_block`` on that the request's tokens fill, through
    node ``node``'s side-car, keyed by the hash chain of ``namespace``."""

    node: int
    first_block: int
    namespace: str

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "first_block": self.first_block, "namespace": self.namespace}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BlockPersist:
        ns = d.get("namespace")
        if not isinstance(ns, str):
            raise ValueError(f"dualpath.store.namespace={ns!r} is invalid: must be a string")
        return cls(
            _int("store.node", d.get("node")), _int("store.first_block", d.get("first_block")), ns
        )


@dataclass(frozen=True, slots=True)
class TransferParams:
    """The ``"dualpath"`` entry of one request's ``kv_transfer_params``."""

    load: BlockLoad | None = None
    save: BlockSave | None = None
    persist: BlockPersist | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, part in (("load", self.load), ("save", self.save), ("store", self.persist)):
            if part is not None:
                out[key] = part.to_dict()
        return out

    @classmethod
    def from_request(cls, kv_transfer_params: dict[str, Any] | None) -> TransferParams | None:
        """The request's DualPath params, or None when it carries none (a plain request)."""
        if not kv_transfer_params or KEY not in kv_transfer_params:
            return None
        d = kv_transfer_params[KEY]
        if not isinstance(d, dict):
            raise ValueError(f"kv_transfer_params.dualpath={d!r} is invalid: must be an object")
        unknown = sorted(set(d) - {"load", "save", "store"})
        if unknown:
            raise ValueError(f"kv_transfer_params.dualpath: unknown field {unknown[0]!r}")
        return cls(
            BlockLoad.from_dict(d["load"]) if d.get("load") else None,
            BlockSave.from_dict(d["save"]) if d.get("save") else None,
            BlockPersist.from_dict(d["store"]) if d.get("store") else None,
        )
