"""Exactly-once streaming across engine faults: a turn whose DE dies after
it streamed some tokens resumes after them: what its client receives only ever grows, and
ends as the fault-free run's answer (greedy and seeded sampling alike)."""

from __future__ import annotations

import json
import os
import random
import signal
import threading
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from dualpath.frontend.tokenizer import TinyTokenizer
from dualpath.frontend.tools import json_grammar
from dualpath.runtime.options import RuntimeOptions
from dualpath.runtime.requests import AgentState
from dualpath.runtime.sampling import SamplingParams
from dualpath.runtime.session import Runtime

from .conftest import small_config

pytestmark = [pytest.mark.slow, pytest.mark.runtime, pytest.mark.timeout(240)]

NUM = 6
NEW = 40


def _requests(vocab: int) -> list[tuple[tuple[int, ...], SamplingParams]]:
    rng = random.Random(5)
    out = []
    for i in range(NUM):
        prompt = tuple(rng.randrange(vocab) for _ in range(20 + 7 * i))
        temperature = 0.0 if i % 2 == 0 else 1.0  # greedy and seeded sampling
        out.append((prompt, SamplingParams(temperature, 0.9, seed=100 + i)))
    return out


def _serve(
    kv_root: Path,
    kill_at: int = 0,
    stop: bool = False,
    requests: list[tuple[tuple[int, ...], SamplingParams]] | None = None,
    logprobs: list[list[Any]] | None = None,
    new: int = NEW,
) -> tuple[list[list[tuple[int, ...]]], int, int]:
    """Every request submitted as a server does: the token sequences each callback got, the
    requests requeued, and how many of those resumed after tokens already delivered. With
    ``kill_at``, DE 2 gets SIGKILL (``stop``: SIGSTOP, found by its silent heartbeat) once a
    request has received that many tokens: mid-stream. ``logprobs`` gets each request's
    log-probabilities when it ends."""
    cfg = small_config(gpus_per_node=2)
    opts = RuntimeOptions(
        kv_root=str(kv_root),
        liveness_timeout_s=2.0,
        request_timeout_s=60.0,
        vocab=TinyTokenizer(cfg.model.vocab_size).vocab_spec(),
    )
    requests = requests or _requests(cfg.model.vocab_size)
    seen: list[list[tuple[int, ...]]] = [[] for _ in range(NUM)]
    done = threading.Event()
    left = [NUM]
    killed: list[int] = []
    with Runtime(cfg, opts) as rt:
        sched = rt.scheduler
        cfg_topo = sched.topo

        def callback(i: int):  # type: ignore[no-untyped-def]
            def on_tokens(rid: int, tokens: tuple[int, ...], finished: bool) -> None:
                seen[i].append(tokens)
                if kill_at and len(tokens) == kill_at and not killed:
                    killed.append(rt.launcher.procs[cfg_topo.engine_name(2)].pid)
                    os.kill(killed[0], signal.SIGSTOP if stop else signal.SIGKILL)
                if finished:
                    if logprobs is not None:
                        logprobs[i] = list(sched.reqs[rid].logprobs)
                    left[0] -= 1
                    if not left[0]:
                        done.set()

            return on_tokens

        for i, (prompt, sampling) in enumerate(requests):
            agent = AgentState(1000 + i, (), ())
            sched.submit_threadsafe(agent, prompt, new, callback(i), sampling)
        result = sched.run(until=done)
        resumed = sum(1 for r in sched.reqs.values() if r.resumed)
    assert bool(killed) == bool(kill_at)
    return seen, result.requeued, resumed


@pytest.mark.parametrize("stop", [False, True], ids=["kill", "stop"])
def test_a_dead_or_stalled_decode_engine_never_sends_a_token_twice(
    tmp_path: Path, stop: bool
) -> None:
    reference, requeued, _ = _serve(tmp_path / "ref")
    assert requeued == 0
    got, requeued, resumed = _serve(tmp_path / "fault", kill_at=12, stop=stop)
    assert requeued >= 1 and resumed >= 1  # some turns died mid-stream and continued
    for i in range(NUM):
        final = reference[i][-1]
        assert len(final) == NEW
        assert got[i][-1] == final, f"request {i}: the answer differs from the fault-free one"
        for before, after in zip(got[i], got[i][1:], strict=False):
            # what the client has only grows: never a token sent twice, never one replaced
            assert after[: len(before)] == before, f"request {i}: tokens re-sent or changed"


def test_a_resumed_turn_keeps_its_grammar_penalties_and_logprobs(tmp_path: Path) -> None:
    """The engine-side state a turn carries (the grammar's matcher, penalty counts) is
    rebuilt from its delivered tokens on the engine it resumes on: the answer, still valid
    under the grammar, and its log-probabilities equal the fault-free run's."""
    tok = TinyTokenizer(small_config(gpus_per_node=2).model.vocab_size)
    items = {"type": "array", "items": {"enum": ["ok", "fail"]}, "minItems": 12, "maxItems": 12}
    grammar = json_grammar(
        {
            "type": "object",
            "properties": {"runs": items},
            "required": ["runs"],
            "additionalProperties": False,
        }
    )
    rng = random.Random(9)
    requests = [
        (
            tuple(rng.randrange(3, 1000) for _ in range(20 + 5 * i)),
            SamplingParams(
                1.0 if i % 2 else 0.0,
                1.0,
                200 + i,
                tok.eos_token_ids,
                grammar=grammar,
                frequency_penalty=0.5,
                logprobs=2,
            ),
        )
        for i in range(NUM)
    ]
    ref_lps: list[list[Any]] = [[] for _ in range(NUM)]
    reference, _, _ = _serve(tmp_path / "ref", requests=requests, logprobs=ref_lps, new=200)
    got_lps: list[list[Any]] = [[] for _ in range(NUM)]
    got, requeued, resumed = _serve(
        tmp_path / "fault", kill_at=12, requests=requests, logprobs=got_lps, new=200
    )
    assert requeued >= 1 and resumed >= 1
    for i in range(NUM):
        final = reference[i][-1]
        assert final[-1] in tok.eos_token_ids  # the grammar ended it
        runs = json.loads(tok.decode(final))["runs"]
        assert len(runs) == 12 and set(runs) <= {"ok", "fail"}
        assert got[i][-1] == final, f"request {i}: the answer differs from the fault-free one"
        assert [lp.token for lp in got_lps[i]] == list(final)
        assert [lp.logprob for lp in got_lps[i]] == pytest.approx([lp.logprob for lp in ref_lps[i]])
