"""The server's side of a request's output: incremental detokenisation and stop strings
(``TextStream``); tokens are chosen on the engines (``runtime.sampling``, ``runtime.token_choice``).
No I/O, no clock."""

from __future__ import annotations

from collections.abc import Sequence

from dualpath.frontend.tokenizer import TextTokenizer


class TextStream:
    """Turns generated token ids into text deltas, holding back incomplete UTF-8 and any tail
    that could still become a stop string; ``stopped`` once a stop string appears (the
    returned text ends before it, as OpenAI's API does)."""

    def __init__(
        self, tokenizer: TextTokenizer, stop: Sequence[str] = (), skip_special_tokens: bool = True
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._stop = tuple(s for s in stop if s)
        self._ids: list[int] = []
        # decode only a window (as vLLM does): ids[_prefix:_read] were already turned into
        # text; decoding from _prefix keeps tokenizers' context for spaces and merges
        self._prefix = 0
        self._read = 0
        self._text = ""  # decoded so far, without incomplete trailing bytes
        self._sent = 0  # characters of _text already returned
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Add one token; return the new text that is safe to send."""
        self._ids.append(token_id)
        before = self._tok.decode(self._ids[self._prefix : self._read], self._skip)
        after = self._tok.decode(self._ids[self._prefix :], self._skip)
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""  # an incomplete UTF-8 sequence (or nothing visible yet): wait
        self._prefix, self._read = self._read, len(self._ids)
        start = len(self._text)
        self._text += after[len(before) :]
        for s in self._stop:
            at = self._text.find(s, max(0, min(self._sent, start) - len(s) + 1))
            if at >= 0:
                self.stopped = True
                self._text = self._text[:at]
                return self._flush(len(self._text))
        hold = max((_overlap(self._text, s) for s in self._stop), default=0)
        return self._flush(len(self._text) - hold)

    def finish(self) -> str:
        """The held-back tail, once generation ended without a stop string: the text held for
        stop strings, and tokens still waiting to complete a UTF-8 sequence, decoded as the
        tokenizer decodes them (U+FFFD for the incomplete bytes), so the whole answer is the
        decode of its tokens, streamed or not."""
        if not self.stopped and self._read < len(self._ids):
            before = self._tok.decode(self._ids[self._prefix : self._read], self._skip)
            after = self._tok.decode(self._ids[self._prefix :], self._skip)
            self._text += after[len(before) :]
            self._prefix = self._read = len(self._ids)
        return self._flush(len(self._text))

    def _flush(self, upto: int) -> str:
        upto = max(upto, self._sent)
        out = self._text[self._sent : upto]
        self._sent = upto
        return out


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``stop``."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
