"""The scheduler process behind ``RuntimeBackend``: it owns a ``Runtime`` (storage workers
and engines are its children) and serves the HTTP process's commands until told to stop.

The HTTP process sends ``SubmitCmd`` / ``CancelCmd`` / ``StopCmd`` on one queue; this process
answers on another: ``ReadyEvt`` once every runtime process acked, ``TokensEvt`` as the engines
generate (new tokens only), ``RejectedEvt`` for a request the runtime refuses, ``StatsEvt``
twice a second, ``HealthEvt`` each time the runtime stops or starts being ready (a process is
being restarted; every restarted one acked), ``FailedEvt`` the moment the run fails (before
its processes are stopped, which takes seconds), ``ClosedEvt`` after the runtime has shut
down (shared memory unlinked).
Nothing here decides anything: the scheduler (``runtime/scheduler/``) does; the stats are the
snapshot it publishes (``Scheduler.publish_stats``), never its state read from this thread.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from dualpath.config import Config
from dualpath.metrics.hops import hop
from dualpath.runtime.options import RuntimeOptions
from dualpath.runtime.requests import AgentState
from dualpath.runtime.sampling import SamplingParams
from dualpath.tokens import TokenLogprob

STATS_PERIOD_S = 0.5
POLL_S = 0.2  # command poll: lets an orphaned host notice that its server is gone


@dataclass(frozen=True, slots=True)
class SubmitCmd:
    key: int  # the server's id for the request (the runtime's id is not known yet)
    prompt: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams
    tenant: str = ""  # salts the request's blocks: tenants never share cached KV


@dataclass(frozen=True, slots=True)
class CancelCmd:
    key: int


@dataclass(frozen=True, slots=True)
class StopCmd:
    pass


@dataclass(frozen=True, slots=True)
class ReadyEvt:
    pids: tuple[int, ...]  # this process and every runtime child
    # what the runtime made outside its processes that must not outlive it if this process
    # is killed: shared-memory segments (node buffers, exchanges) and the links directory
    shm_names: tuple[str, ...] = ()
    link_dir: str = ""


@dataclass(frozen=True, slots=True)
class TokensEvt:
    key: int
    tokens: tuple[int, ...]  # new since the last event of this request
    cached_tokens: int  # prompt tokens whose KV was read from the store (verified)
    done: bool
    logprobs: tuple[TokenLogprob, ...] = ()  # new since the last event (if asked for)


@dataclass(frozen=True, slots=True)
class RejectedEvt:
    key: int
    text: str


@dataclass(frozen=True, slots=True)
class StatsEvt:
    """Runtime state for ``/metrics``: counters are totals since start."""

    num_live: int  # submitted, not finished
    num_waiting: int  # not yet assigned by the policy, or waiting for buffer slots
    requeued: int
    cancelled: int
    persist_failed: int = 0  # block writes dropped (e.g. a full disk)
    kv_bytes_by_path: dict[str, int] = field(default_factory=dict)  # by ``types.KVPath``
    queue_lengths: dict[str, int] = field(default_factory=dict)
    nic_busy_s: dict[str, float] = field(default_factory=dict)  # Σ pacer busy time per NIC
    # per engine, emulated GPU time only: (passes or decode steps, those that overran)
    gpu_passes: dict[str, tuple[int, int]] = field(default_factory=dict)
    now_s: float = 0.0


@dataclass(frozen=True, slots=True)
class HealthEvt:
    """The runtime's readiness changed: ``not_ready`` says why it cannot serve now (a process
    being restarted), "" once it can again."""

    not_ready: str


@dataclass(frozen=True, slots=True)
class FailedEvt:
    """The run failed (``ClosedEvt`` follows once its processes are stopped)."""

    error: str


@dataclass(frozen=True, slots=True)
class ClosedEvt:
    error: str = ""  # empty: a clean stop


class _Host:
    """Relays between the command queue and the scheduler (which runs on the main thread)."""

    def __init__(self, rt: Any, outbox: Any) -> None:
        self.rt = rt
        self.sched = rt.scheduler
        self.outbox = outbox
        self.stop = threading.Event()
        self.rids: dict[int, int] = {}  # key → runtime request id
        self.cancel_early: set[int] = set()  # cancelled before their id was known
        self.live: set[int] = set()  # keys submitted, neither done nor cancelled
        self.next_agent = 0
        self.finished: list[int] = []  # runtime ids of finished requests, to forget
        self.lock = threading.Lock()

    def submit(self, cmd: SubmitCmd) -> None:
        # a request is a turn of a new, scriptless agent: the whole conversation is its prompt
        # (reuse comes from the hash chain, not from the agent's context); the agent counts
        # as finished, so the run never waits for a turn of it that will not come
        agent = AgentState(self.next_agent, (), (), tenant=cmd.tenant)
        self.next_agent += 1
        sent = [0, 0]  # tokens, log-probabilities

        def on_tokens(rid: int, tokens: tuple[int, ...], done: bool) -> None:
            req = self.sched.reqs[rid]
            cached = req.cached
            new, sent[0] = tokens[sent[0] :], len(tokens)
            lps, sent[1] = tuple(req.logprobs[sent[1] :]), len(req.logprobs)
            if done:
                with self.lock:
                    self.live.discard(cmd.key)
                self.rids.pop(cmd.key, None)
                self.finished.append(rid)
            hop("host.tokens", rid)
            self.outbox.put(TokensEvt(cmd.key, new, cached, done, lps))

        def submitted(fut: Future[int]) -> None:
            # on the scheduler's (main) thread, between its loops; rarely the future is done
            # before this callback is added, and it runs here on the command thread instead
            while self.finished and threading.current_thread() is threading.main_thread():
                self.sched.forget(self.finished.pop())
            err = fut.exception()
            if err is not None:
                self.outbox.put(RejectedEvt(cmd.key, str(err)))
                return
            with self.lock:
                self.live.add(cmd.key)
            rid = fut.result()
            self.rids[cmd.key] = rid
            if cmd.key in self.cancel_early:
                self.cancel_early.discard(cmd.key)
                self.cancel(cmd.key)

        fut = self.sched.submit_threadsafe(
            agent, cmd.prompt, cmd.max_tokens, on_tokens, cmd.sampling
        )
        fut.add_done_callback(submitted)

    def cancel(self, key: int) -> None:
        rid = self.rids.pop(key, None)
        if rid is None:
            self.cancel_early.add(key)
            return
        with self.lock:
            self.live.discard(key)
        self.sched.cancel_threadsafe(rid)

    def commands(self, inbox: Any, parent_pid: int) -> None:
        while not self.stop.is_set():
            if os.getppid() != parent_pid:  # the server died: stop, clean up
                self.stop.set()
                return
            try:
                cmd = inbox.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if isinstance(cmd, SubmitCmd):
                hop("host.command", cmd.key)
                self.submit(cmd)
            elif isinstance(cmd, CancelCmd):
                self.cancel(cmd.key)
            elif isinstance(cmd, StopCmd):
                self.stop.set()

    def stats_loop(self, nic_busy: Any) -> None:
        while not self.stop.wait(STATS_PERIOD_S):
            self.outbox.put(self.snapshot(nic_busy))

    def snapshot(self, nic_busy: Any) -> StatsEvt:
        s = self.sched.stats  # the scheduler's last published snapshot: never its live state
        with self.lock:
            num_live = len(self.live)
        return StatsEvt(
            num_live=num_live,
            num_waiting=s.num_waiting,
            requeued=s.requeued,
            cancelled=s.cancelled,
            persist_failed=s.persist_failed,
            kv_bytes_by_path=dict(s.kv_bytes_by_path),
            queue_lengths=dict(s.queue_lengths),
            nic_busy_s=nic_busy() if nic_busy is not None else {},
            gpu_passes=dict(s.gpu_passes),
            now_s=s.now_s,
        )


def host_main(
    config: Config, options: RuntimeOptions, inbox: Any, outbox: Any, parent_pid: int
) -> None:
    """Process entry point: start the runtime, serve commands, shut down on ``StopCmd``."""
    from dualpath.runtime.env import set_process_name
    from dualpath.runtime.liveness import adopt_orphans
    from dualpath.runtime.session import Runtime

    set_process_name("dp-scheduler")
    adopt_orphans()  # a dead fork server's children are reaped here, not left as zombies
    # the server decides when to stop: a Ctrl-C or a SIGTERM sent to the whole process group
    # (a terminal, `timeout`, `kill -- -PGID`) reaches the server, which stops the runtime in
    # order; the engines and storage workers inherit the ignored dispositions (kept across
    # exec), and the launcher still stops or SIGKILLs them itself
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    error = ""
    try:
        with Runtime(config, options) as rt:
            host = _Host(rt, outbox)
            launcher = rt.launcher
            shm: tuple[str, ...] = ()
            if options.runtime == "local":  # (Ray: the segments live with the actors)
                shm = tuple(b.spec.name for b in launcher.buffers)
                shm += tuple(x.name for x in launcher.exchanges)
            link_dir = getattr(launcher, "link_dir", None) or ""
            outbox.put(ReadyEvt((os.getpid(), *rt.pids()), shm, link_dir))
            nic_busy = rt.launcher.nic_busy_s
            rt.scheduler.publish_stats()  # before the stats thread reads its first snapshot
            rt.scheduler.on_health = lambda why: outbox.put(HealthEvt(why))
            threads = [
                threading.Thread(target=host.commands, args=(inbox, parent_pid), daemon=True),
                # (the scheduler itself runs on this, the main, thread)
                threading.Thread(target=host.stats_loop, args=(nic_busy,), daemon=True),
            ]
            for t in threads:
                t.start()
            try:
                rt.scheduler.run(until=host.stop)
            except Exception as err:  # said now: stopping the processes takes seconds
                outbox.put(FailedEvt(f"{type(err).__name__}: {err}"))
                raise
            finally:
                host.stop.set()
    except Exception as err:  # reported in one line; the server fails its requests
        error = f"{type(err).__name__}: {err}"
    outbox.put(ClosedEvt(error))
