"""Bottleneck-free P/D analysis (design §5): bounds on P/D and per-resource loads.

Everything is a fraction of capacity in the steady state where every storage NIC (of both
prefill and decode nodes) reads at full speed and the scheduler balances load, so a share
D/(P+D) of hit bytes takes the DE read path. New-token KV is ignored (hit rate ≈ 98.7%).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from dualpath.config.root import Config


@dataclass(frozen=True, slots=True)
class Bound:
    """One constraint on P/D: ``kind`` is "lower" or "upper"; ``resource`` names what binds."""

    resource: str
    kind: str
    value: float  # the P/D ratio at which ``resource`` is exactly at 100%


@dataclass(frozen=True, slots=True)
class ResourceLoad:
    resource: str
    load_bytes_per_s: float
    capacity_bytes_per_s: float

    @property
    def fraction(self) -> float:
        return self.load_bytes_per_s / self.capacity_bytes_per_s


@dataclass(frozen=True, slots=True)
class PlanReport:
    lower: float  # lowest bottleneck-free P/D
    upper: float  # highest bottleneck-free P/D
    lower_binding: str
    upper_binding: str
    bounds: tuple[Bound, ...]
    always_ok: bool  # PE CNIC read side (s ≤ g/2) and PE DRAM (2sB ≤ M) hold
    num_prefill_nodes: int
    num_decode_nodes: int
    loads: tuple[ResourceLoad, ...]

    @property
    def ratio(self) -> float:
        return self.num_prefill_nodes / self.num_decode_nodes

    @property
    def de_path_share(self) -> float:
        """Share of hit bytes that must take the DE read path: D/(P+D)."""
        p, d = self.num_prefill_nodes, self.num_decode_nodes
        return d / (p + d)

    @property
    def ideal_io_speedup(self) -> float:
        """Storage read bandwidth of DualPath over the classic PE-only path: (P+D)/P."""
        p, d = self.num_prefill_nodes, self.num_decode_nodes
        return (p + d) / p

    @property
    def in_range(self) -> bool:
        eps = 1e-12
        return self.always_ok and self.lower - eps <= self.ratio <= self.upper + eps

    @property
    def bottleneck(self) -> ResourceLoad:
        """The most loaded resource (ties: first in ``loads`` order)."""
        return max(self.loads, key=lambda r: r.fraction)


def bounds(config: Config) -> tuple[Bound, ...]:
    """The P/D bounds of design §5 for this hardware (g GPUs, s, B, M)."""
    hw = config.hardware
    g = hw.gpus_per_node
    s = hw.s_ratio
    mb = hw.dram_bytes_per_s / hw.snic_total_bytes_per_s  # M / (B·s)
    return (
        Bound("PE CNIC write", "lower", s / (g - s) if g > s else float("inf")),
        Bound("DE CNIC read", "upper", (g - 2 * s) / s),
        Bound("DE CNIC write", "upper", (g - s) / (2 * s)),
        Bound("DE DRAM", "upper", (mb - 3) / 2),
    )


def resource_loads(config: Config, p: int, d: int) -> tuple[ResourceLoad, ...]:
    """Per-resource load with every SNIC saturated (design §5's per-engine-pair traffic).

    CNIC "read" = bytes the NIC reads from local memory and sends (incl. loopback H2D);
    CNIC "write" = bytes it writes into local memory (incl. loopback H2D). DRAM is half
    duplex: reads and writes add up.
    """
    if p < 1 or d < 1:
        raise ValueError(f"P={p}, D={d} is invalid: both must be >= 1")
    hw = config.hardware
    g = hw.gpus_per_node
    sb = hw.snic_total_bytes_per_s  # one node's storage read rate, s·B
    b = hw.cnic_bytes_per_s
    m = hw.dram_bytes_per_s
    t_p = sb / (d * g * g)  # PE-path bytes/s between one PE and one DE
    t_c = sb / (p * g * g)  # DE-path bytes/s between one PE and one DE
    return (
        ResourceLoad("PE SNIC read", sb, sb),
        ResourceLoad("DE SNIC read", sb, sb),
        ResourceLoad("PE CNIC read", 2 * t_p * d * g, b),
        ResourceLoad("PE CNIC write", (t_p + t_c) * d * g, b),
        ResourceLoad("DE CNIC read", (t_p + 2 * t_c) * p * g, b),
        ResourceLoad("DE CNIC write", (2 * t_p + t_c) * p * g, b),
        ResourceLoad("PE DRAM", 2 * sb, m),
        ResourceLoad("DE DRAM", (3 + 2 * p / d) * sb, m),
    )


def plan(config: Config, p: int | None = None, d: int | None = None) -> PlanReport:
    """The bottleneck-free range and the loads at P, D (default: the config's cluster)."""
    p = config.cluster.num_prefill_nodes if p is None else p
    d = config.cluster.num_decode_nodes if d is None else d
    bs = bounds(config)
    lowers = [x for x in bs if x.kind == "lower"]
    uppers = [x for x in bs if x.kind == "upper"]
    lo = max(lowers, key=lambda x: x.value)
    hi_value = min(x.value for x in uppers)
    hi_names = [x.resource for x in uppers if abs(x.value - hi_value) <= 1e-9 * max(1, hi_value)]
    hw = config.hardware
    always_ok = (
        hw.s_ratio <= hw.gpus_per_node / 2 and 2 * hw.snic_total_bytes_per_s <= hw.dram_bytes_per_s
    )
    return PlanReport(
        lower=lo.value,
        upper=hi_value,
        lower_binding=lo.resource,
        upper_binding=" = ".join(hi_names),
        bounds=bs,
        always_ok=always_ok,
        num_prefill_nodes=p,
        num_decode_nodes=d,
        loads=resource_loads(config, p, d),
    )


def as_fraction(x: float, max_denominator: int = 64) -> str:
    """1/7, 7/2 … for display; falls back to a decimal when not a small fraction."""
    if x == float("inf"):
        return "∞"
    f = Fraction(x).limit_denominator(max_denominator)
    if abs(float(f) - x) > 1e-9 * max(1.0, abs(x)):
        return f"{x:.4g}"
    return str(f.numerator) if f.denominator == 1 else f"{f.numerator}/{f.denominator}"
