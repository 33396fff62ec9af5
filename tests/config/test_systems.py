"""The system table: one meaning for each system name, and no silent policy override."""

from __future__ import annotations

import pytest

from dualpath.config import apply_overrides, config_for, preset
from dualpath.config.sim import parse_systems
from dualpath.config.systems import POLICY_NAMES, system_spec


def test_systems_map_to_policies() -> None:
    expected = {
        "basic": ("basic", False, False),
        "layer": ("layer", True, False),
        "dpl": ("dpl", True, False),
        "dualpath": ("dualpath", True, False),
        "oracle": ("dualpath", True, True),
    }
    for name, (policy, layerwise, oracle) in expected.items():
        spec = system_spec(name)
        assert (spec.policy, spec.layerwise, spec.oracle) == (policy, layerwise, oracle)
        assert config_for(preset(), spec).scheduler.policy == policy
    assert POLICY_NAMES == ("basic", "layer", "dpl", "dualpath")


def test_a_policy_set_by_the_user_is_honoured_or_refused() -> None:
    config = apply_overrides(preset(), ["scheduler.policy=dpl"])
    assert config_for(config, system_spec("dpl")).scheduler.policy == "dpl"
    with pytest.raises(ValueError, match=r"scheduler\.policy='dpl' conflicts with system 'basic'"):
        config_for(config, system_spec("basic"))


def test_bad_names_are_one_line_value_errors() -> None:
    with pytest.raises(ValueError, match="system='fast'"):
        system_spec("fast")
    with pytest.raises(ValueError, match=r"sim\.systems"):
        parse_systems("basic,nope")
