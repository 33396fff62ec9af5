"""The per-turn latency metrics of design §9, each defined once: every shell, the server's
``/metrics`` and the load generator compute them here. Times in seconds on one clock.

- TTFT: arrival → first token.
- TTST: first → second token (the hand-off to the DE plus its first decode step).
- TPOT: mean time per token after the second, ``(finish − second) / (n − 2)``: the DE's
  steady decode pace, TTST left out (the paper's SLO: TPOT ≤ 50 ms).
- ITL: mean inter-token latency after the first token, ``(finish − first) / (n − 1)``
  (TTST included; what an OpenAI-style server that sees no hand-off reports).

Pure functions of a turn's timestamps; undefined values are None, never 0.
"""

from __future__ import annotations

# metric name → its definition, for docs and the tests that hold every user to this module
DEFINITIONS: dict[str, str] = {
    "ttft_s": "first_token_s - arrival_s",
    "ttst_s": "second_token_s - first_token_s (output_tokens >= 2)",
    "tpot_s": "(finish_s - second_token_s) / (output_tokens - 2) (output_tokens > 2)",
    "itl_s": "(finish_s - first_token_s) / (output_tokens - 1) (output_tokens >= 2)",
}


def ttft_s(arrival_s: float, first_token_s: float) -> float:
    """Time to first token."""
    return first_token_s - arrival_s


def ttst_s(first_token_s: float, second_token_s: float, output_tokens: int) -> float | None:
    """First to second token; None with fewer than two output tokens."""
    return second_token_s - first_token_s if output_tokens >= 2 else None


def tpot_s(second_token_s: float, finish_s: float, output_tokens: int) -> float | None:
    """Mean time per output token after the second; None with two output tokens or fewer."""
    if output_tokens <= 2:
        return None
    return (finish_s - second_token_s) / (output_tokens - 2)


def itl_s(first_token_s: float, finish_s: float, output_tokens: int) -> float | None:
    """Mean inter-token latency after the first token; None with fewer than two tokens."""
    if output_tokens < 2:
        return None
    return (finish_s - first_token_s) / (output_tokens - 1)
