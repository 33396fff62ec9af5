"""The scheduler process: hosts the policy core and drives every turn through the processes.

Turn life: submit (hit tokens from the KV store's hash chain) → policy ``schedule`` (PE, DE,
read side) → buffer slots (wait if full: backpressure) → storage read into the PE or DE
buffer → the PE's local queue → forward passes packed by ``policy.plan_forward`` (an EP
group's PEs in lockstep; a request may take several chunks) → DE batched decode, persist →
next turn of the agent (the core's agent driver). Every step is reported to the ``Core``
(``ledger.core``), which keeps the counters (design §13.4 and the run's bytes per path), builds
the view the policy pulls and the turn records, and emits the typed events observers
subscribe to (``events``), as in the simulator. The package is a loop (``loop.Scheduler``)
over components that own their state (``intake``, ``passes``, ``decodes``, ``durability``,
``recovery``, ``streams``, ``slots``); docs/architecture.md draws a turn's path through them.
"""

from dualpath.runtime.scheduler.loop import IDLE_WAIT_S, Scheduler
from dualpath.runtime.scheduler.recovery import LIVENESS_CHECK_S
from dualpath.runtime.scheduler.stats import SchedulerStats
from dualpath.runtime.scheduler.streams import TokenCallback

__all__ = ["IDLE_WAIT_S", "LIVENESS_CHECK_S", "Scheduler", "SchedulerStats", "TokenCallback"]
