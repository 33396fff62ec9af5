"""The engines' token choice: bias and penalties (hand-computed), grammar masks (valid JSON
from random logits; a resumed chooser continues the same), log-probabilities."""

from __future__ import annotations

import json

import jsonschema
import pytest

torch = pytest.importorskip("torch")
llguidance = pytest.importorskip("llguidance")

from tests.serve.schemas import WEATHER  # noqa: E402

from dualpath.frontend.tokenizer import TinyTokenizer  # noqa: E402
from dualpath.frontend.tools import json_grammar  # noqa: E402
from dualpath.runtime.sampling import SamplingParams  # noqa: E402
from dualpath.runtime.token_choice import (  # noqa: E402
    Chooser,
    GrammarCache,
    apply_masks,
    build_tokenizer,
    choose_batch,
    fill_masks,
)
from dualpath.tokens import VocabSpec  # noqa: E402

TOK = TinyTokenizer(1024)
VOCAB = TOK.vocab_spec()
SCHEMA = WEATHER


def test_bias_and_penalties_are_openais_formula() -> None:
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, logit_bias=((3, 2.0),))
    c = Chooser(p, prefix=(1, 1, 2))  # token 1 twice, token 2 once
    out = c.adjust(torch.zeros(5))
    assert out.tolist() == [0.0, -(2 * 0.25 + 0.5), -(0.25 + 0.5), 2.0, 0.0]
    # greedy with the adjusted logits: token 0 beats 1 once 1 is penalised
    logits = torch.tensor([[1.0, 1.2, 0.0, -5.0, 0.0]])
    assert choose_batch([Chooser(p, prefix=(1,))], logits, [None])[0][0] == 0
    assert choose_batch([Chooser(None)], logits, [None])[0][0] == 1


def test_masks_set_disallowed_logits_to_minus_inf() -> None:
    logits = torch.zeros(3, 40)
    masks = torch.zeros(2, 2, dtype=torch.int32)
    masks[0, 0] = 0b101  # tokens 0 and 2
    masks[1, 1] = 1 << 3  # token 35
    apply_masks(logits, [0, 2], masks)
    allowed = [torch.isfinite(r).nonzero().flatten().tolist() for r in logits]
    assert allowed == [[0, 2], list(range(40)), [35]]


@pytest.mark.parametrize("seed", range(4))
def test_a_grammar_turns_random_logits_into_valid_json(seed: int) -> None:
    grammars = GrammarCache(build_tokenizer(VOCAB, 1024), 1024)
    p = SamplingParams(1.0, 1.0, seed, TOK.eos_token_ids, grammar=json_grammar(SCHEMA))
    c = Chooser(p, (), grammars)
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for i in range(200):
        ((token, _),) = choose_batch([c], torch.randn(1, 1024, generator=gen) * 4, [p.generator(i)])
        out.append(token)
        if token in TOK.eos_token_ids:
            break
    assert out[-1] in TOK.eos_token_ids, "the grammar never ended"
    jsonschema.validate(json.loads(TOK.decode(out)), SCHEMA)


def test_a_resumed_chooser_continues_the_same_masks() -> None:
    grammars = GrammarCache(build_tokenizer(VOCAB, 1024), 1024)
    grammar = json_grammar(SCHEMA)
    text = TOK.encode('{"city":"Par')  # (maxLength 8: the string may go on)
    whole = Chooser(SamplingParams(grammar=grammar), (), grammars)
    for t in text:
        whole.take(t)
    resumed = Chooser(
        SamplingParams(grammar=grammar, first_index=len(text), history=tuple(text)), (), grammars
    )
    logits = torch.randn(1, 1024, generator=torch.Generator().manual_seed(1)).repeat(2, 1)
    a, b = choose_batch([whole, resumed], logits.clone(), [None, None])
    assert a[0] == b[0]
    words = (1024 + 31) // 32
    ma, mb = torch.zeros(words, dtype=torch.int32), torch.zeros(words, dtype=torch.int32)
    whole.fill_mask(ma)
    resumed.fill_mask(mb)
    assert torch.equal(ma, mb) and int(ma.ne(-1).sum()) > 0  # constrained, identically
    # one compile for both (the second a copy of the first's compiled grammar), and a copy
    # starts at the grammar's start, untouched by what the first one consumed
    assert grammars.num_compiled == 1
    fresh = Chooser(SamplingParams(grammar=grammar), (), grammars)
    mf = torch.zeros(words, dtype=torch.int32)
    fresh.fill_mask(mf)
    assert grammars.num_compiled == 1 and not torch.equal(mf, ma)
    assert int(mf[TOK.encode("{")[0] // 32]) != 0  # '{' allowed at the start


def test_batched_masks_equal_the_rows_filled_one_by_one() -> None:
    grammars = GrammarCache(build_tokenizer(VOCAB, 1024), 1024)
    grammar = json_grammar(SCHEMA)
    prefixes = ["", "{", '{"city":"Pa', '{"city":"Paris","unit":"c']
    choosers = [
        Chooser(SamplingParams(grammar=grammar), tuple(TOK.encode(p)), grammars) for p in prefixes
    ]
    words = (1024 + 31) // 32
    batched = torch.zeros((len(choosers), words), dtype=torch.int32)
    fill_masks(choosers, batched)
    for k, c in enumerate(choosers):
        row = torch.zeros(words, dtype=torch.int32)
        c.fill_mask(row)
        assert torch.equal(batched[k], row), prefixes[k]
    assert len({tuple(r.tolist()) for r in batched}) == len(prefixes)  # four different states


def test_logprobs_are_the_raw_distribution() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    p = SamplingParams(logprobs=2, logit_bias=((0, 10.0),))
    ((token, lp),) = choose_batch([Chooser(p)], logits, [None])
    ref = torch.log_softmax(logits[0], -1)
    assert token == 0  # the bias picks it, the log-probabilities stay the model's
    assert lp is not None and lp.logprob == pytest.approx(float(ref[0]))
    assert [t for t, _ in lp.top] == [1, 2]
    assert lp.top[0][1] == pytest.approx(float(ref[1]))


def test_vocab_spec_is_validated() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        VocabSpec(eos_token_ids=(1,))
    with pytest.raises(ValueError, match="eos_token_ids"):
        VocabSpec(tokens=(b"a",))
