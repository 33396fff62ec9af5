"""Progress bars that behave in logs: a tqdm bar on a terminal, one line per ``step_pct``
percent (or nothing) when the stream is not a terminal; never carriage-return floods.

``bar(total, desc)`` returns an object with tqdm's small interface used here (``update``,
``set_postfix_str``, ``total``, ``n``, ``close``, context manager). No module state.
"""

from __future__ import annotations

import sys
from typing import IO, Any

LOG_STEP_PCT = 10  # one line per this many percent when the stream is not a terminal


class LineProgress:
    """Prints ``desc: 30% (3/10) postfix`` each time progress crosses a multiple of
    ``step_pct`` percent, and a last line at close unless 100% was printed, nothing was done
    or an error ends it; with an unknown total, only that last line (none for ``step`` 0)."""

    def __init__(
        self, total: int | None, desc: str, unit: str, stream: IO[str], step_pct: int
    ) -> None:
        self.total = total
        self.n = 0
        self.desc = desc.strip()
        self.unit = unit
        self._stream = stream
        self._step = step_pct
        self._printed = -1  # last percentage step printed
        self._postfix = ""
        self._closed = False

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is not None:  # the error is the news: no last progress line under it
            self._closed = True
        self.close()

    def set_postfix_str(self, text: str) -> None:
        self._postfix = text

    def _line(self) -> str:
        where = f"{self.n}/{self.total}" if self.total else f"{self.n}"
        pct = f"{100 * self.n // self.total}% " if self.total else ""
        post = f" {self._postfix}" if self._postfix else ""
        return f"{self.desc + ': ' if self.desc else ''}{pct}({where} {self.unit}){post}"

    def update(self, k: int = 1) -> None:
        self.n += k
        if not self._step or not self.total:
            return
        step = min(100, 100 * self.n // self.total) // self._step
        if step > self._printed:
            self._printed = step
            print(self._line(), file=self._stream, flush=True)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._step and self.n and (not self.total or self._printed < 100 // self._step):
            print(self._line(), file=self._stream, flush=True)


def bar(
    total: int | None = None,
    desc: str = "",
    unit: str = "it",
    disable: bool = False,
    stream: IO[str] | None = None,
    step_pct: int = LOG_STEP_PCT,
    leave: bool = True,
) -> Any:
    """A progress bar on ``stream`` (default stderr): tqdm on a terminal, ``LineProgress``
    otherwise (``step_pct`` 0: silent), a silent one when ``disable``."""
    out = sys.stderr if stream is None else stream
    if disable:
        return LineProgress(total, desc, unit, out, 0)
    isatty = getattr(out, "isatty", None)
    if callable(isatty) and isatty():
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit=unit, file=out, leave=leave)
    return LineProgress(total, desc, unit, out, step_pct)
