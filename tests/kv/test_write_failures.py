"""The one write-failure policy of every storage node (``kv.worker.WriteFailures``): counted,
named without flooding the log, a path in the way remembered, a full disk tried again."""

from __future__ import annotations

import errno

import pytest

from dualpath.kv.worker import WriteFailures


def test_failures_are_counted_and_reported_without_a_flood(
    capsys: pytest.CaptureFixture[str],
) -> None:
    now = [100.0]
    f = WriteFailures("node1", report_s=10.0, clock=lambda: now[0])
    full = OSError(errno.ENOSPC, "No space left on device")
    for i in range(50):  # a full disk: every write fails within a second
        now[0] += 0.02
        f.failed(f"k{i}", full)
    assert f.num_failed == 50
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "dualpath: node1: block k0 not cached: [Errno 28] No space left on device "
        "(1 dropped so far)"
    ]
    now[0] += 10.0  # a line again once report_s has passed, with the count so far
    f.failed("k50", full)
    assert capsys.readouterr().err.strip().endswith("(51 dropped so far)")
    assert not f.skip("k0")  # a full disk may have room later: the block is tried again


def test_a_path_in_the_way_is_not_tried_again_and_is_forgotten_in_order() -> None:
    f = WriteFailures("storage@node0", remember=2, clock=lambda: 0.0)
    in_the_way = OSError(errno.EISDIR, "Is a directory")
    for key in ("a", "b", "c"):
        f.failed(key, in_the_way)
    assert f.num_failed == 3
    assert not f.skip("a")  # the oldest of more than ``remember`` keys is forgotten
    assert f.skip("b") and f.skip("c") and f.num_failed == 5  # each skip counts as dropped
