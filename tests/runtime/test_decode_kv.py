"""``runtime/decode_kv.py``: the decode batch's KV kept between steps gives the attention the
paged gather gives, as requests join and leave (slots reused, the last moved into a gap)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from dualpath.runtime.attention import SdpaAttention  # noqa: E402
from dualpath.runtime.decode_kv import DecodeKV  # noqa: E402
from dualpath.runtime.hbm import HbmPool  # noqa: E402

LAYERS, PAGE, KVH, HD, HEADS = 2, 8, 2, 16, 4

attend = SdpaAttention().attend


class Req:
    def __init__(self, pool: HbmPool, length: int, gen: torch.Generator) -> None:
        per_layer = pool.pages_for(length + 8)
        pages = pool.alloc(per_layer * LAYERS)
        assert pages is not None
        self.tables = [pages[i * per_layer : (i + 1) * per_layer] for i in range(LAYERS)]
        self.length = length
        for table in self.tables:  # its KV so far, as a DE's admission leaves it
            pool.scatter(table, 0, torch.randn(length, 2, KVH, HD, generator=gen))


def _step(pool: HbmPool, dkv: DecodeKV, reqs: list[Req], gen: torch.Generator) -> None:
    """One decode step both ways: the same new rows, the same attention output."""
    order = dkv.arrange(reqs, [r.tables for r in reqs], [r.length for r in reqs])
    assert sorted(order) == list(range(len(reqs)))
    batch = [reqs[i] for i in order]
    past = [r.length for r in batch]
    new = torch.randn(LAYERS, len(batch), 2, KVH, HD, generator=gen)
    q = torch.randn(len(batch), HEADS, HD, generator=gen)
    step = dkv.batch([r.tables for r in batch], past)
    for layer in range(LAYERS):
        got = attend(q, step.update(layer, new[layer], [1] * len(batch)), past, [1] * len(batch))
        pool_kv = pool.gather_batch([r.tables[layer] for r in batch], [p + 1 for p in past])
        want = attend(q, pool_kv, past, [1] * len(batch))  # the rows were scattered by update
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for r in batch:
        r.length += 1


def test_the_kept_batch_attends_as_the_paged_gather_while_requests_come_and_go() -> None:
    gen = torch.Generator().manual_seed(0)
    pool = HbmPool(256, PAGE, KVH, HD)
    dkv = DecodeKV(pool, LAYERS, torch.device("cpu"), torch.float32)
    a, b, c = Req(pool, 5, gen), Req(pool, 17, gen), Req(pool, 9, gen)
    _step(pool, dkv, [a, b, c], gen)
    _step(pool, dkv, [a, b, c], gen)
    _step(pool, dkv, [a, c], gen)  # b leaves: c moves into its slot
    assert dkv.slots == [a, c]
    d = Req(pool, 300, gen)  # past the capacity: the slots grow, keeping what they hold
    _step(pool, dkv, [a, c, d], gen)
    _step(pool, dkv, [d], gen)  # a and c leave (a leaver at the end, one moved)
    assert dkv.slots == [d]
    _step(pool, dkv, [d, a], gen)  # a comes back (a resumed request): copied in again
