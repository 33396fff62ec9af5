"""Planner (design §5): the paper's ranges, and the binding resource at exactly 100% on a bound."""

from __future__ import annotations

from fractions import Fraction

import pytest

from dualpath.config import apply_overrides, preset
from dualpath.models.planner import as_fraction, plan, resource_loads


def test_paper_example_range() -> None:
    r = plan(preset("ds660b-2p4d"))
    assert r.lower == pytest.approx(1 / 7)
    assert r.upper == pytest.approx(7 / 2)
    assert (as_fraction(r.lower), as_fraction(r.upper)) == ("1/7", "7/2")
    assert r.lower_binding == "PE CNIC write"
    assert "DE CNIC write" in r.upper_binding and "DE DRAM" in r.upper_binding


def test_two_storage_nics_narrow_the_range_and_dram_binds() -> None:
    r = plan(apply_overrides(preset("ds27b-1p1d"), ["hardware.snic_per_node=2"]))
    assert r.lower == pytest.approx(1 / 3)
    assert r.upper == pytest.approx(1.0)
    assert r.upper_binding == "DE DRAM"


@pytest.mark.parametrize("snics", [1, 2])
def test_binding_resource_is_at_exactly_100_percent_on_each_bound(snics: int) -> None:
    c = apply_overrides(preset(), [f"hardware.snic_per_node={snics}"])
    r = plan(c)
    for ratio, names in ((r.lower, [r.lower_binding]), (r.upper, r.upper_binding.split(" = "))):
        f = Fraction(ratio).limit_denominator(1000)
        loads = {x.resource: x.fraction for x in resource_loads(c, f.numerator, f.denominator)}
        for name in names:
            assert loads[name] == pytest.approx(1.0), (ratio, name)
        assert max(loads.values()) == pytest.approx(1.0)  # nothing else over capacity


def test_loads_and_shares_for_2p4d() -> None:
    r = plan(preset("ds660b-2p4d"))
    assert r.in_range
    assert r.de_path_share == pytest.approx(4 / 6)
    assert r.ideal_io_speedup == pytest.approx(3.0)
    loads = {x.resource: x.fraction for x in r.loads}
    assert loads["PE SNIC read"] == loads["DE SNIC read"] == 1.0
    assert loads["PE CNIC read"] == pytest.approx(2 / 8)  # 2Bs/g
    assert loads["DE DRAM"] == pytest.approx((3 + 2 * 0.5) * 50 / 500)


def test_outside_the_range_is_flagged() -> None:
    r = plan(preset(), 1, 8)
    assert not r.in_range
    assert r.bottleneck.resource == "PE CNIC write"
    assert r.bottleneck.fraction > 1


def test_bad_node_counts() -> None:
    with pytest.raises(ValueError, match="P=0"):
        plan(preset(), 0, 2)
