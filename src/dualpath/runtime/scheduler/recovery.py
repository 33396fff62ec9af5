"""Recovery from dead processes: when to look (not every round), which turns a dead engine
takes down with it, how a lost turn goes on (``resume``), and what is being restarted (the
runtime is not ready meanwhile). Pure decisions over the turns; the caller aborts,
resubmits and re-issues reads and writes (it owns those components)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from dualpath.ledger import Phase
from dualpath.runtime.requests import Req
from dualpath.runtime.sampling import SamplingParams

LIVENESS_CHECK_S = 0.05  # how often the run loop looks for dead children (not every round)


@dataclass(frozen=True, slots=True)
class Resume:
    """How an aborted turn goes on. ``finished``: the tokens already delivered end it (no
    new request); else a new request appends ``append`` and generates ``output_tokens``."""

    resumed: tuple[int, ...]  # the turn's output its client already has
    finished: bool
    append: tuple[int, ...] = ()
    output_tokens: int = 0
    sampling: SamplingParams | None = None


def resume(req: Req, context: tuple[int, ...], streaming: bool) -> Resume:
    """Submit an aborted request again, exactly once from its client's view: a streaming
    (server's) turn continues after the tokens already delivered (they end the new prompt;
    the counter-based sampler draws the next ones as the lost engine would have), never
    sending one twice; a turn whose delivered tokens already end it is finished.
    ``context``: its agent's context before the turn."""
    delivered = (req.first_token, *req.streamed) if streaming and req.first_token >= 0 else ()
    resumed = (*req.resumed, *delivered)
    total = len(req.resumed) + req.output_tokens  # the turn's output budget
    stops = req.sampling.stop_token_ids if req.sampling else ()
    if resumed and (len(resumed) >= total or resumed[-1] in stops):
        return Resume(resumed, finished=True)
    append = (*req.tokens[len(context) :], *delivered)
    sampling = req.sampling
    if sampling is not None and resumed:
        sampling = replace(sampling, first_index=len(resumed), history=resumed)
    return Resume(resumed, False, append, total - len(resumed), sampling)


class Recovery:
    """Decides which turns a dead process costs; owns when it last looked and what is being
    restarted (the runtime is not ready until every restarted process acked)."""

    def __init__(self) -> None:
        self._checked_s = float("-inf")  # when the run loop last looked
        self._pending: dict[str, str] = {}  # process being restarted → why

    def begin(self, name: str, why: str) -> bool:
        """``name`` is being restarted; whether this changes the readiness reason."""
        changed = self._pending.get(name) != why
        self._pending[name] = why
        return changed

    def end(self, name: str) -> bool:
        """``name`` is back (its readiness ack came); whether this changes the reason."""
        return self._pending.pop(name, None) is not None

    def restarting(self, name: str) -> bool:
        return name in self._pending

    def not_ready(self) -> str:
        """Why the runtime is not ready now ("" : it is), one line, by process name."""
        return "; ".join(f"{name}: {why}" for name, why in sorted(self._pending.items()))

    def due(self, now: float) -> bool:
        """``liveness_timeout_s`` is seconds: a round every 5 ms need not look each time."""
        if now - self._checked_s < LIVENESS_CHECK_S:
            return False
        self._checked_s = now
        return True

    @staticmethod
    def orphans(engine: int, reqs: Iterable[Req]) -> list[tuple[Req, bool]]:
        """The unfinished turns that depended on dead ``engine``, by id, each with whether its
        slots may be freed now. A dead PE matters until its prefill is done, a dead DE until
        decode is done; slots that a live process may still write (an in-flight read, or a
        pass of another PE) are freed when it reports back, never earlier."""
        out = []
        for req in sorted(reqs, key=lambda r: r.request_id):
            phase = req.phase
            if phase.over or phase is Phase.QUEUED:
                continue
            pe_lost = req.pe == engine and phase.on_pe
            if not (pe_lost or req.de == engine):
                continue
            in_flight = phase is Phase.READING or (phase is Phase.IN_PASS and req.pe != engine)
            out.append((req, not in_flight))
        return out
