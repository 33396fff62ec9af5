"""Scheduler throughput: requests assigned per second at the paper's largest scale.

144 nodes × 8 engines (48 prefill + 96 decode nodes, 1,152 GPUs; design §12 "48P96D") and
48K waiting requests of agentic size (8K–57K prompt, ≈ 99 % hits). A minimal shell applies
each round's Assigns to its counters and, between rounds, lets the round's work finish so
the next round can assign more. Two cluster states: idle (counters drain to zero) and loaded
(DEs keep running decodes, nodes keep read queues). Only ``schedule`` is timed, in CPU time of
this (single-threaded) process; each line is the fastest of ``--repeat`` runs.

Run: .venv/bin/python benchmarks/bench_policy.py [--requests 49152] [--policy dualpath]
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import replace

from dualpath.config import preset
from dualpath.config.cluster import ClusterConfig
from dualpath.models import cost
from dualpath.policy import Assign, ClusterView, EngineState, NodeState, RequestInfo, make_policy
from dualpath.types import EngineKind

PREFILL_NODES, DECODE_NODES, GPUS = 48, 96, 8


def requests(n: int, block: int, rng: random.Random) -> list[RequestInfo]:
    out = []
    for i in range(n):
        prompt = rng.randint(8_000, 57_000)
        hit = (prompt - rng.randint(64, 800)) // block * block
        out.append(RequestInfo(i, prompt, max(hit, 0), rng.randint(50, 300)))
    return out


class Shell:
    """Counters a shell keeps (design §13.4), enough to build each round's view."""

    def __init__(self, ep: bool, de_capacity_tokens: int, loaded: bool, seed: int) -> None:
        self.ep = ep
        self.capacity = de_capacity_tokens
        self.loaded = loaded
        self.rng = random.Random(seed)
        self.pe_ids = list(range(PREFILL_NODES * GPUS))
        first_de = len(self.pe_ids)
        self.de_ids = list(range(first_de, first_de + DECODE_NODES * GPUS))
        self.tok = dict.fromkeys(self.pe_ids + self.de_ids, 0)
        self.seq = dict.fromkeys(self.pe_ids + self.de_ids, 0)
        self.free = dict.fromkeys(self.de_ids, de_capacity_tokens)
        self.read_q = dict.fromkeys(range(PREFILL_NODES + DECODE_NODES), 0)
        self.all_done()

    def node(self, e: int) -> int:
        return e // GPUS

    def view(self) -> ClusterView:
        engines = []
        for e in self.pe_ids + self.de_ids:
            kind = EngineKind.PE if e < len(self.pe_ids) else EngineKind.DE
            group = 0 if self.ep else self.node(e)
            engines.append(
                EngineState(
                    e, self.node(e), group, kind, self.seq[e], self.tok[e], self.free.get(e, 0)
                )
            )
        nodes = [
            NodeState(n, EngineKind.PE if n < PREFILL_NODES else EngineKind.DE, q)
            for n, q in sorted(self.read_q.items())
        ]
        return ClusterView(tuple(engines), tuple(nodes))

    def apply(self, a: Assign, r: RequestInfo) -> None:
        self.tok[a.pe] += r.prompt_tokens
        self.seq[a.pe] += 1
        self.tok[a.de] += r.prompt_tokens
        self.seq[a.de] += 1
        self.free[a.de] -= r.prompt_tokens + r.output_tokens
        self.read_q[self.node(a.pe)] += a.pe_read_tokens
        self.read_q[self.node(a.de)] += a.de_read_tokens

    def all_done(self) -> None:
        """Time passes: the round's work finishes. Idle: every counter drains to zero.
        Loaded: each DE keeps 0–60 % of its HBM in running decodes (≈ 32K tokens each) and
        each node 0–2 α of queued reads, so DE choices hit Z and the no-room paths."""
        rng = self.rng
        for e in self.tok:
            self.tok[e] = self.seq[e] = 0
        for e in self.free:
            used = int(self.capacity * rng.uniform(0.0, 0.6)) if self.loaded else 0
            self.tok[e], self.seq[e] = used, (used + 32_767) // 32_768
            self.free[e] = self.capacity - used
        for n in self.read_q:
            self.read_q[n] = rng.randint(0, 7_500_000) if self.loaded else 0


def run(
    policy_name: str, num_requests: int, ep: bool, loaded: bool, seed: int
) -> tuple[float, str]:
    """One full drain of the queue; returns (seconds inside ``schedule``, summary line)."""
    config = preset("ds660b-2p4d")
    config = replace(
        config,
        cluster=ClusterConfig(PREFILL_NODES, DECODE_NODES, prefill_ep=ep, decode_ep=ep),
        scheduler=replace(config.scheduler, policy=policy_name),
    )
    capacity = cost.kv_capacity_tokens(config.model, config.hardware, DECODE_NODES * GPUS)
    policy = make_policy(config)
    shell = Shell(ep, capacity, loaded, seed)
    reqs = requests(num_requests, config.scheduler.block_tokens, random.Random(seed))
    by_id = {r.request_id: r for r in reqs}
    t0 = time.perf_counter()
    for r in reqs:
        policy.submit(r, 0.0)
    submit_s = time.perf_counter() - t0
    sched_s = 0.0
    assigned = rounds = 0
    while policy.num_waiting and rounds < 50:
        view = shell.view()
        t0 = time.process_time()  # CPU time of this process: robust on a shared machine
        out = policy.schedule(view, float(rounds))
        sched_s += time.process_time() - t0
        rounds += 1
        if not out:
            break
        for a in out:
            shell.apply(a, by_id[a.request_id])
        assigned += len(out)
        shell.all_done()
    label = ("EP groups" if ep else "per-node groups") + (", loaded" if loaded else ", idle")
    line = (
        f"{policy_name:9s} {label:24s} α={policy.alpha_tokens} β={policy.beta_tokens} "
        f"rounds={rounds} assigned={assigned}/{num_requests} schedule={sched_s:.3f} CPU-s "
        f"→ {assigned / sched_s:,.0f} assignments/s (submit {num_requests / submit_s:,.0f}/s)"
    )
    return sched_s, line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=48 * 1024)
    ap.add_argument("--policy", default="all", choices=("all", "basic", "dpl", "dualpath"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=3, help="report the fastest of N runs")
    args = ap.parse_args()
    names = ("dualpath", "basic", "dpl") if args.policy == "all" else (args.policy,)
    print(
        f"48P96D: {PREFILL_NODES * GPUS} PEs + {DECODE_NODES * GPUS} DEs, "
        f"{args.requests} waiting requests, best of {args.repeat}"
    )
    for name in names:
        for loaded in (False, True):
            for ep in (True, False):
                runs = [run(name, args.requests, ep, loaded, args.seed) for _ in range(args.repeat)]
                print(min(runs)[1])


if __name__ == "__main__":
    main()
