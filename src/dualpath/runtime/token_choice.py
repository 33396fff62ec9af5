"""Per-request token choice on the engines: logit bias, presence / frequency penalties, the
grammar mask (llguidance), then ``sampling.sample``; and the log-probabilities a client asked
for. Runs where sampling happens: the PE's first token and every DE step, batched.

A ``Chooser`` is rebuilt from ``SamplingParams`` alone (its ``history`` is the turn's output
so far), so a respawned engine or a resumed turn continues exactly where the other left off.
torch and llguidance are imported where they are used (the scheduler never needs them).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dualpath.runtime.sampling import SamplingParams, sample
from dualpath.tokens import TokenLogprob, VocabSpec, grammar_key

if TYPE_CHECKING:
    from torch import Tensor


class _ByteVocab:
    """llguidance's tokenizer protocol over a list of token byte strings (greedy encode)."""

    def __init__(self, spec: VocabSpec) -> None:
        self.tokens = list(spec.tokens)
        self.eos_token_id = spec.eos_token_ids[0]
        self.bos_token_id = None
        self.special_token_ids = list(spec.special_ids)
        special = set(spec.special_ids)
        self._ids = {t: i for i, t in enumerate(self.tokens) if i not in special and t}
        self._longest = max((len(t) for t in self._ids), default=1)

    def __call__(self, text: bytes | str) -> list[int]:
        data = text.encode() if isinstance(text, str) else text
        out, i = [], 0
        while i < len(data):
            for k in range(min(self._longest, len(data) - i), 0, -1):
                tid = self._ids.get(data[i : i + k])
                if tid is not None:
                    out.append(tid)
                    i += k
                    break
            else:  # a byte no token spells (the vocabulary is not byte-complete): skip it
                i += 1
        return out


def build_tokenizer(spec: VocabSpec, vocab_size: int) -> Any:
    """llguidance's ``LLTokenizer`` for ``spec``, padded to the model's ``vocab_size``
    (~1 s for a 150K vocabulary: build once per engine)."""
    import llguidance

    eos = list(spec.eos_token_ids)
    if spec.tokenizer_json:
        with open(spec.tokenizer_json, encoding="utf-8") as f:
            return llguidance.LLTokenizer(f.read(), n_vocab=vocab_size, eos_token=eos)
    wrapper = llguidance.TokenizerWrapper(_ByteVocab(spec))
    return llguidance.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=eos)


class GrammarCache:
    """One engine's compiled grammars by ``grammar_key`` (LRU, ``size`` of them): a request
    gets a copy of the compiled matcher (microseconds) instead of a compile (up to the
    server's ``--grammar-budget-s``, which the server checks before a grammar gets here)."""

    def __init__(self, tokenizer: Any, vocab_size: int, size: int = 64) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.size = size
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self.num_compiled = 0
        self._executor: Any = None

    @property
    def executor(self) -> Any:
        """llguidance's thread pool for a batch's masks (``fill_masks``), built on first use."""
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor()
        return self._executor

    def matcher(self, grammar: str) -> Any:
        """A fresh matcher for ``grammar`` (at its start state)."""
        import llguidance
        import numpy as np

        key = grammar_key(grammar)
        proto = self._compiled.get(key)
        if proto is None:
            proto = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
            self.num_compiled += 1
            if not proto.is_error():  # the lexer builds lazily: once here, shared by copies
                scratch = np.zeros((self.vocab_size + 31) // 32, dtype=np.int32)
                proto.unsafe_compute_mask_ptr(scratch.ctypes.data, scratch.nbytes)
            self._compiled[key] = proto
            while len(self._compiled) > self.size:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        return proto.deep_copy()


class Chooser:
    """One request's token choice on one engine (see the module docstring). ``grammars``:
    the engine's compiled grammars (needed only when ``params.grammar`` is set)."""

    def __init__(
        self,
        params: SamplingParams | None,
        prefix: Sequence[int] = (),
        grammars: GrammarCache | None = None,
    ) -> None:
        self.params = params
        self.counts: dict[int, int] = {}
        self.matcher: Any = None
        self.grammars = grammars
        output = (*(params.history if params else ()), *prefix)
        if params is not None and params.grammar:
            if grammars is None:
                raise ValueError(
                    "a grammar-constrained request reached an engine without a vocabulary"
                )
            self.matcher = grammars.matcher(params.grammar)
        for t in output:
            self._accept(t)

    @property
    def constrained(self) -> bool:
        return self.matcher is not None

    @property
    def penalised(self) -> bool:
        p = self.params
        return p is not None and (p.presence_penalty != 0 or p.frequency_penalty != 0)

    def _accept(self, token: int) -> None:
        if self.penalised:
            self.counts[token] = self.counts.get(token, 0) + 1
        if self.matcher is not None and not self.matcher.is_error():
            self.matcher.consume_token(token)

    def fill_mask(self, row: Tensor) -> None:
        """Write the grammar's allowed tokens into ``row`` (an int32 bitmask row)."""
        m = self.matcher
        if m.is_error():  # cannot happen under the mask; end the request rather than guess
            eos = self.params.stop_token_ids if self.params else ()
            if eos:  # (never none: a grammar with ignore_eos is refused by the API)
                t = eos[0]
                row.zero_()
                row[t // 32] = 1 << (t % 32) if t % 32 < 31 else -(1 << 31)
            return
        m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    def adjust(self, logits: Tensor) -> Tensor:
        """Bias and penalties applied to one request's logits [vocab] (a new tensor)."""
        p = self.params
        if p is None or not (p.logit_bias or self.counts):
            return logits
        out = logits.float().clone()
        for t, b in p.logit_bias:
            out[t] += b
        if self.counts:
            import torch

            ids = torch.tensor(list(self.counts), dtype=torch.long)
            n = torch.tensor(list(self.counts.values()), dtype=out.dtype)
            out[ids] -= n * p.frequency_penalty + p.presence_penalty
        return out

    def take(self, token: int) -> None:
        """The engine chose ``token`` for this request."""
        self._accept(token)


def fill_masks(choosers: Sequence[Chooser], masks: Tensor) -> None:
    """Row k of ``masks`` (int32 bitmask rows) ← the grammar of ``choosers[k]``: the healthy
    matchers in one call of llguidance's batched ``fill_next_token_bitmask_par`` (its thread
    pool, the GIL released), a matcher in error row by row (``Chooser.fill_mask``)."""
    import torch

    par = [(c.matcher, k) for k, c in enumerate(choosers) if not c.matcher.is_error()]
    for k, c in enumerate(choosers):
        if c.matcher.is_error():
            c.fill_mask(masks[k])
    if len(par) == 1:  # (one row: no pool round trip)
        choosers[par[0][1]].fill_mask(masks[par[0][1]])
    elif par:
        grammars = next(c.grammars for c in choosers if c.grammars is not None)
        # what llguidance.torch.fill_next_token_bitmask_par does, without importing that
        # module: its torch.compile kernel imports dynamo (3 s on an engine's first batch)
        if not masks.is_contiguous() or masks.dtype != torch.int32:
            raise ValueError("fill_masks: masks must be contiguous int32 rows")
        grammars.executor.unsafe_compute_mask_ptr(
            par, masks.data_ptr(), masks.shape[1] * 4, masks.shape[0]
        )


def apply_masks(logits: Tensor, rows: Sequence[int], masks: Tensor) -> None:
    """Set to -inf, in place, every logit of ``logits[rows[i]]`` whose bit is 0 in
    ``masks[i]`` (int32 words, bit j of word w = token 32·w + j, as llguidance writes)."""
    import numpy as np
    import torch

    if not rows:
        return
    vocab = logits.shape[-1]
    # little-endian words: byte k of the row holds tokens 8k .. 8k+7, lowest bit first
    packed = masks.contiguous().view(torch.uint8).numpy()
    allowed = np.unpackbits(packed, axis=1, bitorder="little")[:, :vocab].astype(bool)
    banned = torch.from_numpy(~allowed).to(logits.device)
    if len(rows) == logits.shape[0] and list(rows) == list(range(logits.shape[0])):
        logits.masked_fill_(banned, float("-inf"))
        return
    index = torch.tensor(list(rows), dtype=torch.long, device=logits.device)
    sub = logits.index_select(0, index)
    sub.masked_fill_(banned, float("-inf"))
    logits.index_copy_(0, index, sub)


def choose_batch(
    choosers: Sequence[Chooser], logits: Tensor, generators: Sequence[Any]
) -> list[tuple[int, TokenLogprob | None]]:
    """One token for each row of ``logits`` [batch, vocab]: bias and penalties, the batch's
    grammar masks in one pass, then greedy / nucleus sampling with each row's generator.
    Each chooser has taken its token when this returns. Runs on the host (a GPU's logits are
    copied once: B × vocab floats per step, small beside a decode step)."""
    import torch

    if logits.device.type != "cpu":  # one copy per step: masks, generators and bias are host-side
        logits = logits.float().cpu()
    raw = logits
    work = logits
    constrained = [i for i, c in enumerate(choosers) if c.constrained]
    adjusted = [
        i
        for i, c in enumerate(choosers)
        if c.params is not None and (c.params.logit_bias or c.counts)
    ]
    if constrained or adjusted:
        work = logits.float().clone()
        for i in adjusted:
            work[i] = choosers[i].adjust(logits[i])
    if constrained:
        words = (work.shape[-1] + 31) // 32
        masks = torch.full((len(constrained), words), -1, dtype=torch.int32)
        fill_masks([choosers[i] for i in constrained], masks)
        apply_masks(work, constrained, masks)
    out: list[tuple[int, TokenLogprob | None]] = []
    for i, c in enumerate(choosers):
        p = c.params
        if p is None or p.temperature <= 0.0 or generators[i] is None:
            token = int(work[i].argmax())
        else:
            token = sample(work[i], p.temperature, p.top_p, generators[i])
        c.take(token)
        lp = None
        if p is not None and p.logprobs is not None:
            lp = _logprob(raw[i], token, p.logprobs)
        out.append((token, lp))
    return out


def _logprob(logits: Tensor, token: int, top: int) -> TokenLogprob:
    import torch

    logp = torch.log_softmax(logits.float(), dim=-1)
    best: tuple[tuple[int, float], ...] = ()
    if top > 0:
        values, ids = torch.topk(logp, min(top, logp.shape[-1]))  # sorted, largest first
        best = tuple((int(t), float(v)) for t, v in zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprob(token, float(logp[token]), best)
