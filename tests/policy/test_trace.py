"""Decision trace: every decision recorded, explainable, JSONL round trip."""

from __future__ import annotations

from pathlib import Path

from policy_testkit import de, pe, policy, req, view

from dualpath.policy import explain, read_jsonl, to_jsonl, write_jsonl


def traced_round(record: bool = True):  # type: ignore[no-untyped-def]
    p = policy(record_decisions=record)
    for i in range(3):
        p.submit(req(i, prompt=1000, hit=640), 0.0)
    v = view(
        [pe(0, 0), pe(1, 0, tok=50), de(10, 1, 10**6, group=0), de(20, 2, 10**6, group=1)],
        read_q={0: 2000, 1: 0, 2: 100},
    )
    return p, p.schedule(v, 5.0)


def test_every_request_has_pe_group_de_and_side_records() -> None:
    p, out = traced_round()
    for a in out:
        kinds = [r["kind"] for r in explain(p.decisions(), a.request_id)]
        assert kinds == ["pe", "de_group", "de", "side"]
        why = {r["kind"]: r for r in explain(p.decisions(), a.request_id)}
        assert why["pe"]["chosen"] == a.pe
        assert why["de"]["chosen"] == a.de
        assert why["side"]["side"] == a.read_side.value
        assert why["side"]["now"] == 5.0


def test_pe_record_explains_category() -> None:
    p, _ = traced_round()
    first = explain(p.decisions(), 0)[0]
    assert first["category"] == 3  # node 0's read queue 2000 > α = 1000
    assert (first["num_overloaded"], first["num_short_read_q"], first["num_long_read_q"]) == (
        0,
        0,
        2,
    )
    assert first["chosen"] == 0 and first["runners_up"] == [{"engine": 1, "tokens": 50}]


def test_side_record_shows_queues_compared() -> None:
    p, _out = traced_round()
    side = explain(p.decisions(), 0)[-1]
    assert side["pe_read_q_before"] == 2000
    assert side["de_read_q_before"] in (0, 100)
    assert side["side"] == "de"


def test_disabled_trace_is_empty_and_decisions_identical() -> None:
    _p_on, out_on = traced_round(True)
    p_off, out_off = traced_round(False)
    assert p_off.decisions() == []
    assert out_on == out_off


def test_jsonl_round_trip(tmp_path: Path) -> None:
    p, _ = traced_round()
    path = tmp_path / "decisions.jsonl"
    assert write_jsonl(p.decisions(), path) == len(p.decisions())
    assert read_jsonl(path) == p.decisions()
    assert to_jsonl(p.decisions()).count("\n") == len(p.decisions())


def test_wait_records() -> None:
    p = policy(record_decisions=True, beta_tokens=50)
    for i in range(3):
        p.submit(req(i), 0.0)
    p.schedule(view([pe(0, 0), de(10, 1, 5)]), 0.0)
    kinds = [r["kind"] for r in p.decisions()]
    assert "pe_wait" in kinds  # PE 0 overloaded after one request (100 > β)
    assert explain(p.decisions(), 0)[-1]["kind"] == "de_wait"  # DE has 5 tokens free


def test_docs_example_why_de_5() -> None:
    """The worked example of docs/policy.md, kept honest."""
    from dualpath.policy import ClusterView, EngineState, NodeState, PolicyParams, RequestInfo
    from dualpath.policy import build_policy as build
    from dualpath.types import EngineKind as K

    p = build(
        "dualpath",
        PolicyParams(alpha_tokens=100_000, beta_tokens=200_000, record_decisions=True),
        lambda pairs: 0.0,
    )
    v = ClusterView(
        engines=(
            EngineState(0, 0, 0, K.PE, seq=2, tokens=60_000),
            EngineState(1, 0, 0, K.PE, seq=1, tokens=30_000),
            EngineState(2, 1, 1, K.DE, seq=4, tokens=90_000, free_hbm_tokens=400_000),
            EngineState(3, 1, 1, K.DE, seq=3, tokens=70_000, free_hbm_tokens=420_000),
            EngineState(4, 2, 2, K.DE, seq=3, tokens=50_000, free_hbm_tokens=450_000),
            EngineState(5, 2, 2, K.DE, seq=1, tokens=40_000, free_hbm_tokens=460_000),
        ),
        nodes=(NodeState(0, K.PE, 150_000), NodeState(1, K.DE, 20_000), NodeState(2, K.DE, 5_000)),
    )
    for i, (prompt, hit) in enumerate([(33_000, 32_640), (20_000, 19_840), (41_000, 40_768)]):
        p.submit(RequestInfo(i, prompt, hit, output_tokens=200), now=0.0)
    out = p.schedule(v, now=12.5)
    assert [(a.request_id, a.pe, a.de, a.read_side.value) for a in out] == [
        (0, 1, 5, "de"),
        (1, 0, 5, "de"),
        (2, 1, 4, "de"),
    ]
    pe_rec, group_rec, de_rec, side_rec = explain(p.decisions(), 1)
    assert (pe_rec["category"], pe_rec["chosen"], pe_rec["chosen_tokens"]) == (3, 0, 60_000)
    assert (group_rec["chosen_group"], group_rec["chosen_load_tokens"]) == (2, 123_200)
    assert de_rec["z_tokens"] == 96_915.0 and de_rec["decision"] == "normal"
    assert (de_rec["chosen"], de_rec["chosen_seq"], de_rec["runners_up"][0]["engine"]) == (5, 2, 4)
    assert (side_rec["pe_read_q_before"], side_rec["de_read_q_before"]) == (150_000, 37_640)
