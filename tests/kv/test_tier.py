"""A node's DRAM tier (``kv.tier``): copies of whole blocks, least recently used out first."""

from __future__ import annotations

import pytest

from dualpath.kv.tier import DramTier


def test_get_copies_the_block_and_counts_hits_and_misses() -> None:
    tier = DramTier(100)
    tier.put("a", b"x" * 40)
    out = memoryview(bytearray(40))
    assert tier.get("a", out) and bytes(out) == b"x" * 40
    assert not tier.get("b", out)
    assert (tier.hits, tier.misses, len(tier)) == (1, 1, 1)


def test_least_recently_used_goes_first_and_a_put_keeps_its_own_copy() -> None:
    tier = DramTier(100)
    src = bytearray(b"a" * 40)
    tier.put("a", memoryview(src))
    src[:] = b"z" * 40  # the slot it came from is reused: the tier's copy is unchanged
    tier.put("b", b"b" * 40)
    out = memoryview(bytearray(40))
    assert tier.get("a", out) and bytes(out) == b"a" * 40  # "a" is now the most recent
    tier.put("c", b"c" * 40)  # 120 > 100: "b" goes
    assert "b" not in tier and "a" in tier and "c" in tier
    assert (tier.used_bytes, tier.evicted) == (80, 1)


def test_a_block_larger_than_the_tier_is_not_kept_and_a_bad_size_is_refused() -> None:
    tier = DramTier(10)
    tier.put("big", b"x" * 11)
    assert len(tier) == 0 and tier.used_bytes == 0
    with pytest.raises(ValueError, match="capacity_bytes=-1 is invalid"):
        DramTier(-1)
