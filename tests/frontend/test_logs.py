"""``frontend/logs.py``: repeats within the window are counted, not written; the next record
after the window and ``flush`` say how many were held back; a cap on all kinds together."""

from __future__ import annotations

import io
import logging

from dualpath.frontend.logs import RepeatFilter


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _logger(filt: RepeatFilter) -> tuple[logging.Logger, io.StringIO]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(filt)
    log = logging.getLogger(f"test-repeat-{id(filt)}")
    log.propagate = False
    log.handlers = [handler]
    return log, out


def test_a_repeated_error_is_written_once_per_window_with_its_count() -> None:
    clock = Clock()
    filt = RepeatFilter(window_s=60, clock=clock)
    log, out = _logger(filt)
    for i in range(10_000):
        try:
            raise OSError(24, "Too many open files")
        except OSError:
            log.exception("accept failed on socket %d", i)
    assert out.getvalue().count("Traceback") == 1
    assert len(out.getvalue()) < 1000
    clock.now = 61
    log.error("accept failed on socket %d", 1)  # another kind: no exception
    try:
        raise OSError(24, "Too many open files")
    except OSError:
        log.exception("accept failed on socket %d", 2)
    assert "[9999 more like this in the last 61 s]" in out.getvalue()
    assert filt.held == 9999


def test_flush_reports_what_was_held_back() -> None:
    clock = Clock()
    filt = RepeatFilter(window_s=60, clock=clock)
    log, out = _logger(filt)
    for _ in range(5):
        log.warning("Invalid HTTP request received.")
    filt.flush(log)
    assert "4 more like 'Invalid HTTP request received.' not written" in out.getvalue()
    filt.flush(log)  # once
    assert out.getvalue().count("not written") == 1


def test_distinct_messages_are_capped_per_window() -> None:
    clock = Clock()
    filt = RepeatFilter(window_s=60, max_per_window=10, clock=clock)
    log, out = _logger(filt)
    for i in range(1000):
        log.warning(f"client {i} did something")  # f-strings: every record its own kind
    assert out.getvalue().count("did something") == 10
    clock.now = 60
    log.warning("client 5000 did something")
    assert out.getvalue().count("did something") == 11
    assert "[990 more log records over the rate limit were not written" in out.getvalue()
    for i in range(20):
        log.warning(f"client {i} again")
    filt.flush(log)
    assert "11 more log records over the rate limit not written" in out.getvalue()
