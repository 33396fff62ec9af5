"""DE groups: one decode batch per DE, all DEs of an EP group stepping in lockstep (design §7, §13).

Requests join at the next step boundary after their H2D; each step produces one token per
resident request; a request leaves after its last token. Steps are computed in macro-steps of
up to ``macro_steps`` steps per event (cut short when a request joins), which gives exactly the
step-by-step timeline: every step's duration is the same function of the same batch.

KV traffic into and out of a DE's HBM (H2D of joining prompts, D2H of blocks persisted
during decode) takes HBM bandwidth from its memory-bound decode steps: the contention model
of ``cost.hbm_dma_delay_s`` (docs/calibration.md, "Decode-node contention").
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, bisect_right
from collections.abc import Callable

from dualpath.config import HardwareConfig, ModelConfig
from dualpath.ledger import DecodeStepsDone, EventBus
from dualpath.models import cost
from dualpath.sim.events import Event, EventLoop, Priority
from dualpath.sim.request import Req
from dualpath.sim.steptime import step_column_fn, step_time_fn

# intervals of at most this many steps are planned step by step; longer ones from per-member
# columns kept across intervals (``DecodeGroup._column``)
_SHORT_INTERVAL = 4


class DecodeGroup:
    """``members`` DE ids; ``num_gpus`` = EP size the weights are sharded over (1 without EP).

    A step lasts the slowest member's ``cost.decode_step_time_s`` (lockstep MoE); members with
    no resident request wait. Context of a resident request = prompt + tokens generated so far
    (the first token, produced by the PE, counts from the join).

    ``h2d_bytes_per_token`` / ``d2h_bytes_per_token``: bytes DMA'd into a DE's HBM per
    prompt token of a joining request, and out of it per generated token (0 when those
    transfers are free or off). An H2D that lands while the group is stepping delays that
    DE's next step by ``cost.hbm_dma_delay_s`` of its bytes; D2H delays every step by that of
    the step's new tokens. An H2D into an idle group overlaps no step and costs nothing.
    """

    def __init__(
        self,
        members: tuple[int, ...],
        *,
        loop: EventLoop,
        model: ModelConfig,
        hw: HardwareConfig,
        num_gpus: int,
        macro_steps: int,
        on_finish: Callable[[Req], None],
        events: EventBus | None = None,
        h2d_bytes_per_token: float = 0.0,
        d2h_bytes_per_token: float = 0.0,
    ) -> None:
        self.members = members
        self.loop = loop
        self.model = model
        self.hw = hw
        self.num_gpus = num_gpus
        self.macro_steps = macro_steps
        self.on_finish = on_finish
        self.events = events if events is not None else EventBus()
        self.step_time_s = step_time_fn(model, hw, num_gpus)
        self._step_column = step_column_fn(model, hw, num_gpus)
        self.index = {de: i for i, de in enumerate(members)}
        n = len(members)
        self.batch = [0] * n  # resident requests per DE
        self.context = [0] * n  # Σ context tokens of residents, at the last boundary
        self.generated = [0] * n  # Σ tokens generated for residents, at the last boundary
        self.heap: list[tuple[int, int, Req]] = []  # (finish step, request id, request)
        self.pending: list[Req] = []
        self.step = 0  # steps completed at the last boundary
        self.times: list[float] = []  # end times of the steps of the current interval
        self.event: Event | None = None
        self.running = False
        self.interval_start_s = 0.0
        self.num_steps = 0
        self.num_boundaries = 0
        self.busy_s = [0.0] * n  # time each DE spent in steps with a resident request
        self.h2d_delay_per_token_s = cost.hbm_dma_delay_s(hw, h2d_bytes_per_token)
        self.d2h_delay_per_token_s = cost.hbm_dma_delay_s(hw, d2h_bytes_per_token)
        self.h2d_debt_s = [0.0] * n  # H2D delay not yet charged to a step
        self.dma_delay_s = [0.0] * n  # step time each DE lost to DMA contention, in total
        # per member: (batch, context at col[0], col) with col[j] = step time + D2H delay of a
        # step at that batch and context + batch·j (``_column``)
        self._columns: list[tuple[int, int, list[float]] | None] = [None] * n

    # ------------------------------------------------------------------ queries
    def generated_now(self, de: int) -> int:
        """Tokens generated so far by ``de``'s residents, counting steps completed by now."""
        i = self.index[de]
        done = bisect_right(self.times, self.loop.now) if self.times else 0
        return self.generated[i] + self.batch[i] * done

    def generated_stamp(self) -> tuple[int, int]:
        """(boundaries so far, steps of the current interval done by now): changes whenever
        ``generated_by_member`` may change (at a boundary, or when a step ends)."""
        return self.num_boundaries, bisect_right(self.times, self.loop.now) if self.times else 0

    def generated_by_member(self) -> list[int]:
        """``generated_now`` of every member, in ``members`` order."""
        done = bisect_right(self.times, self.loop.now) if self.times else 0
        if not done:
            return self.generated
        return [g + b * done for g, b in zip(self.generated, self.batch, strict=True)]

    # ------------------------------------------------------------------ joins
    def join(self, req: Req) -> None:
        """``req``'s KV is in DE HBM: it joins the batch at the next step boundary."""
        self.pending.append(req)
        now = self.loop.now
        if self.running:  # the H2D overlapped this DE's steps
            self.h2d_debt_s[self.index[req.de]] += req.prompt_tokens * self.h2d_delay_per_token_s
        else:
            self.running = True
            self.times = []
            self.event = self.loop.at(now, self._boundary, Priority.START, "de_boundary")
            return
        j = bisect_left(self.times, now)  # the step in progress ends at times[j]
        if j < len(self.times) - 1:
            assert self.event is not None
            self.loop.cancel(self.event)
            del self.times[j + 1 :]
            self.event = self.loop.at(
                self.times[j], self._boundary, Priority.COMPLETION, "de_boundary"
            )

    # ------------------------------------------------------------------ boundaries
    def _boundary(self) -> None:
        self.num_boundaries += 1
        now = self.loop.now
        steps = len(self.times)
        batch, context, generated = self.batch, self.context, self.generated
        if steps and self.events.wants(DecodeStepsDone):
            self.events.emit(
                DecodeStepsDone(now, self.members, tuple(batch), steps, self.interval_start_s)
            )
        if steps:
            span = now - self.interval_start_s
            for i, b in enumerate(batch):
                if b:
                    context[i] += b * steps
                    generated[i] += b * steps
                    self.busy_s[i] += span
                    self.dma_delay_s[i] += b * steps * self.d2h_delay_per_token_s
            self.step += steps
            self.num_steps += steps
        self.times = []
        heap = self.heap
        while heap and heap[0][0] <= self.step:
            _, _, req = heapq.heappop(heap)
            i = self.index[req.de]
            batch[i] -= 1
            context[i] -= req.prompt_tokens + req.output_tokens
            generated[i] -= req.output_tokens
            req.finish_s = now
            self.on_finish(req)
        joined = self.pending
        self.pending = []
        for req in joined:
            i = self.index[req.de]
            batch[i] += 1
            context[i] += req.prompt_tokens + 1
            generated[i] += 1
            heapq.heappush(heap, (self.step + req.output_tokens - 1, req.request_id, req))
        if not heap:
            self.running = False
            self.event = None
            return
        self._plan_interval(heap[0][0] - self.step)
        for req in joined:
            req.second_token_s = self.times[0]
        self.event = self.loop.at(
            self.times[-1], self._boundary, Priority.COMPLETION, "de_boundary"
        )

    def _plan_interval(self, until_next_finish: int) -> None:
        """Step end times of the next ``min(until_next_finish, macro_steps)`` steps."""
        num = min(until_next_finish, self.macro_steps)
        debt, dma = self.h2d_debt_s, self.dma_delay_s
        if num <= _SHORT_INTERVAL:  # few steps: no column worth keeping
            self._plan_short(num)
            return
        cols = []
        first = 0.0
        for i, b in enumerate(self.batch):
            if not b:
                continue
            col = self._column(i, b, num)
            cols.append(col)
            d = col[0] + debt[i]  # the H2D delay is charged to this first step only
            if d > first:
                first = d
            dma[i] += debt[i]
            debt[i] = 0.0
        t = self.interval_start_s = self.loop.now
        times = self.times
        t += first
        times.append(t)
        if num > 1:
            durs = list(map(max, *cols)) if len(cols) > 1 else cols[0]
            for j in range(1, num):
                t += durs[j]
                times.append(t)

    def _plan_short(self, num: int) -> None:
        """``_plan_interval`` for a few steps, step by step (the same values a column has)."""
        step_time = self.step_time_s
        d2h, debt, dma = self.d2h_delay_per_token_s, self.h2d_debt_s, self.dma_delay_s
        active = [
            (b, c, i, b * d2h)
            for i, (b, c) in enumerate(zip(self.batch, self.context, strict=True))
            if b
        ]
        t = self.interval_start_s = self.loop.now
        times = self.times
        first = max([step_time(b, c) + extra + debt[i] for b, c, i, extra in active])
        for _, _, i, _ in active:  # the H2D delay is charged to this first step only
            dma[i] += debt[i]
            debt[i] = 0.0
        t += first
        times.append(t)
        for j in range(1, num):
            t += max([step_time(b, c + b * j) + extra for b, c, _, extra in active])
            times.append(t)

    def _column(self, i: int, b: int, num: int) -> list[float]:
        """Member ``i``'s step time plus D2H delay for each of the next ``num`` steps at
        batch ``b``: ``step_time_s(b, context + b·j) + b · d2h`` for j < ``num``.

        Kept per member and reused while its batch does not change (an interval cut short by
        a join recomputes nothing for members whose batch stayed): the same function of the
        same (batch, context), so exactly the values a fresh computation gives."""
        c = self.context[i]
        cached = self._columns[i]
        if cached is not None and cached[0] == b:
            k, rest = divmod(c - cached[1], b)
            col = cached[2]
            if not rest and k >= 0:
                if k + num <= len(col):
                    return col[k : k + num]
                col = col[k:] if k < len(col) else []
            else:
                col = []
        else:
            col = []
        col.extend(self._step_column(b, c, len(col), num, b * self.d2h_delay_per_token_s))
        self._columns[i] = (b, c, col)
        return col
