"""The runtime's entry point: start the processes, run agents to completion, shut down.

    with Runtime(config, RuntimeOptions(system="dualpath")) as rt:
        result = rt.run(agent_scripts(...))   # dualpath.workload.scripts

Ctrl-C or any failure stops every process and removes the shared-memory buffers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import TracebackType

from dualpath.config import Config, config_for
from dualpath.ledger import TurnDone
from dualpath.metrics import TurnRecord
from dualpath.policy import make_policy
from dualpath.runtime.launcher import Launcher
from dualpath.runtime.options import RuntimeOptions
from dualpath.runtime.requests import AgentState
from dualpath.runtime.result import RunResult
from dualpath.runtime.scheduler import Scheduler
from dualpath.workload.scripts import AgentScript


def make_launcher(config: Config, options: RuntimeOptions) -> Launcher:
    """Local processes, or Ray actors placed per node (``options.runtime == "ray"``)."""
    if options.runtime == "ray":
        from dualpath.runtime.ray_launcher import RayLauncher

        return RayLauncher(config, options)
    return Launcher(config, options)


class Runtime:
    """Processes emulating the cluster of ``config`` (design §2): on this host, or as Ray
    actors over a Ray cluster's nodes (``RuntimeOptions.runtime``)."""

    def __init__(self, config: Config, options: RuntimeOptions) -> None:
        if config.scheduler.split_reads:  # rejected, never silently ignored
            raise ValueError(
                "scheduler.split_reads=true is not supported by the runtime (each request reads "
                "its hit KV through one node): use the simulator, or set it to false"
            )
        if options.spec.reuse == "dram-tier" and config.reuse.dram_tier_peer_pull:
            raise ValueError(
                "reuse.dram_tier_peer_pull=true is not supported by the runtime (a node's "
                "tier serves its own node): use the simulator, or set it to false"
            )
        if options.model_dir:  # the checkpoint's dimensions size buffers, store and pools
            from dualpath.runtime.hf_model import with_checkpoint

            config = with_checkpoint(config, options.model_dir, options.dtype)
        self.config = config_for(config, options.spec)
        self.options = options
        self.launcher = make_launcher(self.config, options)
        self._scheduler: Scheduler | None = None

    def __enter__(self) -> Runtime:
        try:
            env = self.launcher.start()
        except BaseException:
            self.launcher.close()
            raise
        self._scheduler = Scheduler(self.launcher, env, make_policy(self.config))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.launcher.close()

    @property
    def scheduler(self) -> Scheduler:
        if self._scheduler is None:
            raise RuntimeError("Runtime is not started: use it as a context manager")
        return self._scheduler

    def run(
        self,
        agents: Sequence[AgentScript | AgentState],
        on_turn: Callable[[TurnRecord], None] | None = None,
    ) -> RunResult:
        """Serve every agent's turns to the end (offline: all agents start together); a
        script starts a fresh ``AgentState``, a given state goes on from its progress."""
        sched = self.scheduler
        if on_turn is not None:
            sched.events.subscribe(TurnDone, lambda ev: on_turn(ev.record))
        states = [a if isinstance(a, AgentState) else AgentState.from_script(a) for a in agents]
        for agent in states:
            sched.add_agent(agent)
        for agent in states:
            sched.start_agent(agent)
        return sched.run()

    def pids(self) -> list[int]:
        return self.launcher.pids()
