"""Load balance: max/avg overall and in sliding windows."""

from __future__ import annotations

import pytest

from dualpath.metrics import max_over_avg, windowed_max_over_avg


def test_max_over_avg() -> None:
    assert max_over_avg([2.0, 2.0, 2.0]) == 1.0
    assert max_over_avg([3.0, 1.0]) == 1.5
    assert max_over_avg([4.0, 0.0, 0.0, 0.0]) == 4.0
    assert max_over_avg([0.0, 0.0]) == 1.0  # idle is balanced
    with pytest.raises(ValueError, match="empty"):
        max_over_avg([])
    with pytest.raises(ValueError, match=">= 0"):
        max_over_avg([1.0, -1.0])


def test_windowed_hand_computed() -> None:
    samples = [
        (0.0, [4.0, 0.0]),
        (1.0, [0.0, 4.0]),
        (2.0, [2.0, 2.0]),
        (3.0, [0.0, 0.0]),
        (4.0, [0.0, 0.0]),
    ]
    got = windowed_max_over_avg(samples, window_s=2.0)
    # windows (t-2, t]: {0}, {0,1}, {1,2}, {2,3}, {3,4}
    assert got == [
        (0.0, 2.0),
        (1.0, 1.0),  # sums [4, 4]
        (2.0, pytest.approx(6 / 4)),  # sums [2, 6]
        (3.0, 1.0),  # sums [2, 2]
        (4.0, 1.0),  # idle window: exactly zero, balanced, no rounding residue
    ]


def test_windowed_idle_after_many_uneven_values_is_exactly_balanced() -> None:
    samples = [(float(t), [0.1 * t, 0.3, 0.0]) for t in range(100)]
    samples += [(100.0 + t, [0.0, 0.0, 0.0]) for t in range(10)]
    assert windowed_max_over_avg(samples, window_s=5.0)[-1] == (109.0, 1.0)


def test_windowed_validation() -> None:
    assert windowed_max_over_avg([], 1.0) == []
    with pytest.raises(ValueError, match="window_s"):
        windowed_max_over_avg([(0.0, [1.0])], 0.0)
    with pytest.raises(ValueError, match="expected 2"):
        windowed_max_over_avg([(0.0, [1.0, 1.0]), (1.0, [1.0])], 1.0)
    with pytest.raises(ValueError, match="backwards"):
        windowed_max_over_avg([(1.0, [1.0]), (0.0, [1.0])], 1.0)
    with pytest.raises(ValueError, match="negative"):
        windowed_max_over_avg([(1.0, [-1.0])], 1.0)
