"""Simulator settings: which systems to run, traffic manager, fidelity knobs, output.

Frozen and validated like every config section; the simulator reads it, never writes it.
"""

from __future__ import annotations

from dataclasses import dataclass

from dualpath.config.checks import non_negative, positive, require
from dualpath.config.systems import SYSTEM_NAMES


def parse_systems(text: str) -> tuple[str, ...]:
    """'basic, dualpath,oracle' → ('basic', 'dualpath', 'oracle'); ValueError on unknown names."""
    names = tuple(part.strip().lower() for part in str(text).split(",") if part.strip())
    require(len(names) > 0, "sim.systems", text, "a comma-separated list of systems")
    for name in names:
        require(name in SYSTEM_NAMES, "sim.systems", name, "one of " + ", ".join(SYSTEM_NAMES))
    require(len(set(names)) == len(names), "sim.systems", text, "a list without repeats")
    return names


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Knobs of the discrete-event simulator (docs/simulator.md explains each).

    ``systems``: comma-separated subset of ``SYSTEM_NAMES`` (a string, so that
    ``--set sim.systems=basic,dualpath`` works). ``pull_interval_s``: group leaders pull
    work at most this often (a pull happens only when something changed).
    ``reads_per_node``: storage reads a node serves at once (FIFO). ``rail_matched``: KV
    between a PE and a DE buffer crosses the DE node's CNIC on the PE's rail (else the DE's
    own). ``per_layer``: simulate every layer's transfers explicitly instead of the exact
    pipeline aggregation (slow; for checks). ``decode_macro_steps``: decode steps computed per
    event at most (1 = one event per step). ``persist_interval_s``: a decode node starts a
    persistence write at most this often (writes gate nothing; batching saves flows).
    ``next_turn_after_persist``: an agent's next turn is submitted only once the previous
    turn's new blocks (prompt and decode) have been written to storage, as the runtime does
    (its next turn's hits are then what design §9 says the previous turn persisted); its arrival
    stays the previous turn's finish, so the wait counts as queueing. Default off: the paper
    submits the next turn at the previous one's finish (its blocks are still in the DE
    buffer while they are written). With it on, block writes are not batched: each turn's
    go as their own flow, in order, at once (``persist_interval_s`` does not apply).
    ``max_sim_s``: stop at this simulated time (0 = run until every turn is done).
    ``classic_read_ahead_requests`` / ``classic_read_ahead_bytes``: how far a non-layerwise
    (classic, Basic) PE's storage reads may run ahead of its HBM admission, in requests or in
    read bytes per PE (either allowance; ``inf`` bytes: reads start at assignment, bounded
    only by the PE buffer). Default 0 / 0: the classic engine allocates HBM for a request
    before it reads the request's KV (the paper's Fig. 12 TTFT breakdown puts allocation
    before reading; vLLM's KV connectors load external KV into blocks the scheduler has
    allocated). Layerwise systems read into the PE buffer as the paper sizes it.
    """

    systems: str = "basic,dualpath,oracle"
    traffic_manager: bool = True
    low_floor: float = 0.01  # low-priority share of a busy CNIC (weighted round robin, design §6)
    pull_interval_s: float = 0.01
    reads_per_node: int = 1
    rail_matched: bool = True  # DE-buffer KV crosses the DE node's CNIC on the PE's rail
    per_layer: bool = False
    decode_macro_steps: int = 64
    collectives: bool = True
    persistence: bool = True
    persist_interval_s: float = 1.0  # a decode node starts a persistence write at most this often
    next_turn_after_persist: bool = False  # the runtime's rule: the next turn waits for durability
    max_sim_s: float = 0.0
    classic_read_ahead_requests: int = 0  # per classic PE, beyond the HBM-admitted requests
    classic_read_ahead_bytes: float = 0.0  # per classic PE, beyond the HBM-admitted requests
    out_dir: str = ""  # "" = runs/<deterministic name from the config>

    def __post_init__(self) -> None:
        parse_systems(self.systems)
        require(0 < self.low_floor < 1, "sim.low_floor", self.low_floor, "in (0, 1)")
        non_negative("sim.pull_interval_s", self.pull_interval_s)
        require(
            isinstance(self.reads_per_node, int) and self.reads_per_node >= 1,
            "sim.reads_per_node",
            self.reads_per_node,
            "an integer >= 1",
        )
        require(
            isinstance(self.decode_macro_steps, int) and self.decode_macro_steps >= 1,
            "sim.decode_macro_steps",
            self.decode_macro_steps,
            "an integer >= 1",
        )
        non_negative("sim.max_sim_s", self.max_sim_s)
        non_negative("sim.persist_interval_s", self.persist_interval_s)
        require(
            isinstance(self.classic_read_ahead_requests, int)
            and self.classic_read_ahead_requests >= 0,
            "sim.classic_read_ahead_requests",
            self.classic_read_ahead_requests,
            "an integer >= 0",
        )
        require(
            self.classic_read_ahead_bytes >= 0,
            "sim.classic_read_ahead_bytes",
            self.classic_read_ahead_bytes,
            ">= 0 (inf: reads start at assignment)",
        )
        if self.max_sim_s:
            positive("sim.max_sim_s", self.max_sim_s)

    @property
    def system_list(self) -> tuple[str, ...]:
        return parse_systems(self.systems)
