"""Rate-limited logging: a record that repeats one already written within the window is
counted, not written; the next one after the window says how many were held back, and so
does ``flush`` at exit. A log under abuse (a malformed request a millisecond, descriptors
exhausted) grows by a few lines a minute, never by a traceback per event.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

LOGGERS = ("", "uvicorn", "uvicorn.error", "uvicorn.access", "dualpath")


@dataclass(slots=True)
class _Seen:
    since: float  # when the record last written was
    held: int = 0  # like it since then, not written


class RepeatFilter(logging.Filter):
    """Let through the first record of a kind per ``window_s`` (a kind: logger, level,
    message template, exception type) and at most ``max_per_window`` records of all kinds;
    the rest are counted. ``max_kinds`` bounds the memory (oldest kinds forgotten first)."""

    def __init__(
        self,
        window_s: float = 60.0,
        max_per_window: int = 100,
        max_kinds: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.window_s = window_s
        self.max_per_window = max_per_window
        self.max_kinds = max_kinds
        self.clock = clock
        self._kinds: OrderedDict[tuple[str, int, str, str], _Seen] = OrderedDict()
        self._window = _Seen(clock())  # every kind: ``held`` counts records over the cap
        self._written = 0  # in this window
        self.held = 0  # held back in all, since the start

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "repeat_summary", False):
            return True
        now = self.clock()
        exc = record.exc_info[0].__name__ if record.exc_info and record.exc_info[0] else ""
        key = (record.name, record.levelno, str(record.msg), exc)
        seen = self._kinds.get(key)
        if seen is not None and now - seen.since < self.window_s:
            seen.held += 1
            self.held += 1
            return False
        notes = []
        if now - self._window.since >= self.window_s:
            if self._window.held:
                notes.append(
                    f"{self._window.held} more log records over the rate limit "
                    f"were not written in the last {now - self._window.since:.0f} s"
                )
            self._window, self._written = _Seen(now), 0
        if self._written >= self.max_per_window:
            self._window.held += 1
            self.held += 1
            return False
        self._written += 1
        if seen is not None and seen.held:
            notes.append(f"{seen.held} more like this in the last {now - seen.since:.0f} s")
        if notes:
            note = "".join(f" [{n}]" for n in notes)
            record.msg = str(record.msg) + note.replace("%", "%%")
        self._kinds[key] = _Seen(now)
        self._kinds.move_to_end(key)
        while len(self._kinds) > self.max_kinds:
            self._kinds.popitem(last=False)
        return True

    def summaries(self) -> list[str]:
        """One line per kind with records held back since it was last written."""
        out = [
            f"{k[0] or 'root'}: {s.held} more like {k[2][:120]!r} not written"
            for k, s in self._kinds.items()
            if s.held
        ]
        if self._window.held:
            out.append(f"{self._window.held} more log records over the rate limit not written")
        return out

    def flush(self, logger: logging.Logger | None = None) -> None:
        """Write the summaries (at exit), once."""
        log = logger or logging.getLogger("dualpath")
        for line in self.summaries():
            log.warning(line, extra={"repeat_summary": True})
        for seen in self._kinds.values():
            seen.held = 0
        self._window.held = 0


def install(filt: RepeatFilter | None = None) -> RepeatFilter:
    """Put ``filt`` (a new one by default) on every handler of the server's loggers and on
    logging's last-resort handler (where records of loggers with no handler, asyncio's
    among them, are written)."""
    filt = filt or RepeatFilter()
    handlers = [h for name in LOGGERS for h in logging.getLogger(name).handlers]
    if logging.lastResort is not None:
        handlers.append(logging.lastResort)
    for handler in handlers:
        if filt not in handler.filters:
            handler.addFilter(filt)
    return filt
