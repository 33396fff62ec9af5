"""Emulated GPU time: an engine's pass completes no earlier than the cost model says.

``GpuTime`` binds the cost model (``dualpath.models.cost``, the simulator's formulas) to the
run's model, hardware preset and group sizes, and holds every forward pass to it: the engine
computes the real tokens with its model, then waits until the pass's emulated time has
passed, as a ``Pacer`` completes a transfer no earlier than bytes / rate. A pass whose host
compute took longer than its emulated time *overran*: the emulated GPU was not the bottleneck
there, the host was (``GpuUse`` counts them). With ``gpu_time="host"`` nothing waits and the
host's compute time is the pass time (on CUDA, the real GPU's). No clock of its own: the
caller's ``now`` and ``sleep``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dualpath.config import HardwareConfig, ModelConfig
from dualpath.models import cost

GPU_TIMES = ("emulated", "host")


@dataclass(slots=True)
class GpuUse:
    """One engine's passes (PE forward passes or DE decode steps) under emulated GPU time:
    how many, how many overran, Σ emulated seconds and Σ host compute seconds."""

    passes: int = 0
    overran: int = 0
    emulated_s: float = 0.0
    host_s: float = 0.0

    def add(self, emulated_s: float, host_s: float) -> None:
        self.passes += 1
        self.overran += host_s > emulated_s
        self.emulated_s += emulated_s
        self.host_s += host_s

    @property
    def overrun_share(self) -> float:
        """Share of passes whose host compute exceeded their emulated time (NaN: none ran)."""
        return self.overran / self.passes if self.passes else float("nan")


class GpuTime:
    """The emulated time of an engine's passes on ``hw`` (design §13's cost model, the
    simulator's charges): a PE pass is ``prefill_fixed_s`` + the group's GEMMs split over its
    ``group_size`` GPUs (``prefill_linear_time_s``) + this PE's attention; a DE step is
    ``decode_step_time_s`` over its batch, the weights spread over ``decode_gpus``."""

    def __init__(
        self, model: ModelConfig, hw: HardwareConfig, group_size: int, decode_gpus: int
    ) -> None:
        self.model = model
        self.hw = hw
        self.group_size = max(1, group_size)
        self.decode_gpus = max(1, decode_gpus)
        self._attention = cost.attention_time_fn(model, hw)
        self._fixed_s = cost.prefill_fixed_s(model, hw, self.group_size)

    def prefill_s(self, pairs: Sequence[tuple[int, int]], group_new_tokens: int) -> float:
        """One PE's pass of ``(cached, new)`` chunks while its group computes
        ``group_new_tokens`` new tokens in all (the simulator's ``PassPlan`` time, as seen by
        this PE: its own attention, the group's GEMMs shared evenly)."""
        linear = cost.prefill_linear_time_s(
            self.model, self.hw, group_new_tokens / self.group_size, self.group_size
        )
        return self._fixed_s + linear + self._attention(pairs)

    def decode_s(self, batch: int, context_tokens: int) -> float:
        """One decode step of ``batch`` requests attending ``context_tokens`` in all."""
        return cost.decode_step_time_s(self.model, self.hw, batch, context_tokens, self.decode_gpus)


class LayerFloor:
    """Holds one pass, layer by layer, to ``emulated_s`` (split evenly over ``num_layers``):
    layer ``l`` computes once its KV is loaded and ends no earlier than ``layer_s`` after
    that, so loads overlap the emulated compute of the previous layer as on a GPU. The caller
    reports ``waited`` (seconds blocked on loads inside the layer) and calls ``layer_done``
    after each layer's compute; ``host_s`` is the pass's compute time without the waits.
    ``emulated_s=None``: host time (no floor; ``host_s`` is still measured)."""

    def __init__(
        self,
        emulated_s: float | None,
        num_layers: int,
        now: Callable[[], float],
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.emulated_s = emulated_s
        self.layer_s = None if emulated_s is None else emulated_s / max(1, num_layers)
        self.now = now
        self.sleep = sleep
        self.start_s = now()
        self._layer_start = self.start_s
        self._waited = 0.0
        self.host_s = 0.0

    def waited(self, seconds: float) -> None:
        """The current layer was blocked ``seconds`` on something not compute (its loads)."""
        self._waited += seconds

    def layer_done(self) -> None:
        """The layer's compute is done: wait out the rest of its emulated time."""
        t = self.now()
        self.host_s += max(0.0, t - self._layer_start - self._waited)
        if self.layer_s is not None:
            floor = self._layer_start + self._waited + self.layer_s
            if floor > t:
                self.sleep(floor - t)
                t = self.now()
        self._layer_start, self._waited = t, 0.0

    def restart(self) -> None:
        """The next layer starts now (time since the last ``layer_done`` was not compute:
        e.g. the group's collective)."""
        self._layer_start, self._waited = self.now(), 0.0


def hold_until(deadline_s: float, now: Callable[[], float], sleep: Callable[[float], None]) -> None:
    """Sleep until ``now() >= deadline_s`` (a decode step's emulated end)."""
    left = deadline_s - now()
    if left > 0:
        sleep(left)
