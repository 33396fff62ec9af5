"""The GPU check's steps (run by scripts/gpu_check.sh, which owns the temp dir and the trap).

For tiny random Llama / Qwen2 / Qwen3 checkpoints: `dualpath serve --device cuda` must give the
same greedy tokens, on a first turn and on a second turn read back from the KV store, as the same
server on `--device cpu` and as transformers' `generate` on CUDA (float32). Then the agent API
on CUDA (a forced tool call and a json_schema reply valid under the engines' grammar masks,
logprobs), the suite's CUDA tests, and DualPath inside vLLM (`serve --engine vllm` against a
plain vLLM instance, where vLLM is installed). Prints one PASS/FAIL line per check and a summary; exit 0 all passed, 1 a check failed,
2 no CUDA device (without --dry-run). --dry-run runs every "cuda" step on cpu.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

from dualpath.frontend.checkpoint import write_tiny_checkpoint
from dualpath.frontend.tokenizer import HFTokenizer

ARCHS = ("llama", "qwen2", "qwen3")
BLOCK_TOKENS = 16
NEW_TOKENS = 12
READY_TIMEOUT_S = 180.0  # a server's start: the runtime's processes, CUDA init, weights
REQUEST_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0  # SIGTERM → exit; then SIGKILL to the server's whole process group
PYTEST_TIMEOUT_S = 300.0
PYTEST_ARGS = "-q tests/runtime/test_hf_model.py -k cuda"  # the suite's CUDA tests
FIRST_TURNS = (  # one conversation each; no two share a Full Block, so each turn 1 misses
    "Run the tests. " * 6,
    "Summarise the repository layout and the failing test, then propose a fix.",
    "def main():\n    print('hello world')\n    return 0\n" * 2,
)
SECOND_TURN = "Observation: 3 passed. Now fix the bug."
REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True, slots=True)
class Reply:
    text: str
    completion_tokens: int
    cached_tokens: int


class Server:
    """One `dualpath serve` on 127.0.0.1, in its own session so that it and its engine processes
    die together. While it runs, ``pid_dir/<pid>`` exists: the shell's trap kills what is left."""

    def __init__(self, args: list[str], log_path: Path, pid_dir: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        dualpath = Path(sys.executable).parent / "dualpath"
        argv = [str(dualpath), "serve", "--host", "127.0.0.1", "--port", str(self.port), *args]
        with log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                start_new_session=True,
            )
        self.pid_file = pid_dir / str(self.proc.pid)
        try:
            self.pid_file.touch()
        except BaseException:  # never leave a server that nobody will stop
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} before ready")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.3)
        raise RuntimeError(f"server not ready after {READY_TIMEOUT_S:.0f} s")

    def complete(self, prompt: list[int]) -> Reply:
        body = {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
        req = urllib.request.Request(
            self.url + "/v1/completions",
            json.dumps(body).encode(),
            {"content-type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as resp:
                out = json.load(resp)
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"HTTP {e.code}: {e.read().decode(errors='replace')}") from e
        usage = out["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return Reply(out["choices"][0]["text"], int(usage["completion_tokens"]), int(cached))

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=STOP_TIMEOUT_S)
        with contextlib.suppress(ProcessLookupError):  # stray engine processes, or a hung server
            os.killpg(self.proc.pid, signal.SIGKILL)
        code = self.proc.wait()
        self.pid_file.unlink(missing_ok=True)
        return code

    def log_tail(self, lines: int = 8) -> str:
        tail = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        return "\n".join("    | " + line for line in tail)


class Reference:
    """transformers' model of a checkpoint on ``device``, float32: greedy tokens and the logits
    behind them (to explain a mismatch)."""

    def __init__(self, ckpt: Path, device: str) -> None:
        self.device = torch.device(device)
        model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
        self.model = model.to(self.device).eval()  # type: ignore[arg-type]  # .to's stub
        self.model.generation_config.eos_token_id = None  # exactly the tokens asked for

    def generate(self, prompt: list[int], num_tokens: int) -> list[int]:
        ids = torch.tensor([prompt], device=self.device)
        with torch.no_grad():
            out = self.model.generate(
                ids, max_new_tokens=num_tokens, do_sample=False, pad_token_id=0
            )
        return [int(t) for t in out[0, len(prompt) :]]

    def top_logits(self, ids: list[int], k: int = 5) -> list[tuple[int, float]]:
        """The ``k`` largest next-token logits after ``ids``, best first: (token id, logit)."""
        with torch.no_grad():
            logits = self.model(torch.tensor([ids], device=self.device)).logits[0, -1]
        values, indices = logits.float().topk(k)
        return [(int(i), float(v)) for i, v in zip(indices, values, strict=True)]


class Report:
    """The PASS/FAIL lines, in the order the checks ran."""

    def __init__(self) -> None:
        self.num_passed = 0
        self.failed: list[str] = []

    def check(self, ok: bool, name: str, detail: str = "") -> bool:
        print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)
        if ok:
            self.num_passed += 1
        else:
            self.failed.append(name)
        return ok


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _visible(text: str) -> str:
    """``text`` without a trailing incomplete UTF-8 tail (U+FFFD): served replies and the
    reference's decode are compared on what both show for sure."""
    return text.rstrip("\ufffd")


def _first(diffs: list[str], num_shown: int = 2) -> str:
    more = len(diffs) - num_shown
    return "; ".join(diffs[:num_shown]) + (f"; and {more} more replies differ" if more > 0 else "")


def _fits(tok: HFTokenizer, ids: list[int], got: str) -> bool:
    """Whether ``ids`` decode to a prefix of the served text ``got``."""
    return got.startswith(_visible(tok.decode(ids)))


def explain(
    ref: Reference, tok: HFTokenizer, prompt: list[int], expected: list[int], got: str
) -> str:
    """Where the served text ``got`` leaves the reference's greedy tokens, and the reference's
    logit gap there (a tiny gap is a float near-tie between devices; a large one is a bug)."""
    k = next((k for k in range(len(expected)) if not _fits(tok, expected[: k + 1], got)), None)
    if k is None:
        want = _visible(tok.decode(expected))
        return f"texts differ in lone bytes or length: reference {want!r}, served {got!r}"
    top = ref.top_logits(prompt + expected[:k])
    shown = len(_visible(tok.decode(expected[:k])))

    def is_served(c: int) -> bool:  # fits the served text and shows more of it
        ids = [*expected[:k], c]
        return _fits(tok, ids, got) and len(_visible(tok.decode(ids))) > shown

    served = next((c for c, _ in top if is_served(c)), None)
    where = f"first visible difference at generated token {k} (reference id {expected[k]})"
    logit = dict(top)
    if served is None or expected[k] not in logit:
        gap = top[0][1] - top[1][1]
        best = ", ".join(f"id {c}: {v:.4f}" for c, v in top)
        return f"{where}: reference top-2 logit gap {gap:.3g} (top 5: {best}); served {got!r}"
    gap = logit[expected[k]] - logit[served]
    return f"{where}: served id {served}, reference logit gap {gap:.3g}"


def serve_turns(
    args: list[str], work: Path, pid_dir: Path, prompts: list[list[int]]
) -> tuple[list[Reply], str]:
    """Start a server, send ``prompts`` in turn, stop it. Returns the replies and a problem
    ("" if none: every reply ran, the server exited 0)."""
    server = Server(args, work / "serve.log", pid_dir)
    replies: list[Reply] = []
    problem = ""
    try:
        server.wait_ready()
        replies = [server.complete(p) for p in prompts]
    except (OSError, RuntimeError, KeyError, ValueError) as e:
        problem = f"{type(e).__name__}: {e}"
    finally:
        code = server.stop()
    if not problem and code != 0:
        problem = f"server exited with {code} on SIGTERM"
    if problem:
        problem += "\n" + server.log_tail()
    return replies, problem


def reference_turns(ref: Reference, tok: HFTokenizer) -> tuple[list[list[int]], list[list[int]]]:
    """The prompts (turn 1, turn 2 of each conversation, in order) and the reference's tokens.
    Turn 2 re-sends the conversation, as an agent does: its Full Blocks come from the store."""
    prompts, expected = [], []
    for text in FIRST_TURNS:
        first = tok.encode(tok.render_chat([{"role": "user", "content": text}]))
        first_out = ref.generate(first, NEW_TOKENS)
        second = [*first, *first_out, *tok.encode(SECOND_TURN)]
        prompts += [first, second]
        expected += [first_out, ref.generate(second, NEW_TOKENS)]
    return prompts, expected


def check_server(
    name: str, args: list[str], work: Path, pid_dir: Path, prompts: list[list[int]], report: Report
) -> list[str] | None:
    """Serve ``prompts``; check every reply's length and that only turn 2 hits the store.
    Returns the visible texts, or None if the server gave none."""
    replies, problem = serve_turns(args, work, pid_dir, prompts)
    if problem:
        report.check(False, name, problem)
        return None
    counts = [r.completion_tokens for r in replies]
    cached = [r.cached_tokens for r in replies]
    ok = set(counts) == {NEW_TOKENS} and not any(cached[0::2]) and all(cached[1::2])
    detail = f"completion_tokens={counts}, cached_tokens={cached} (only each turn 2 may hit)"
    report.check(ok, name, detail)
    return [_visible(r.text) for r in replies]


def check_arch(arch: str, tmp: Path, device: str, report: Report) -> None:
    """Serve ``arch`` on ``device`` and on cpu; compare both with transformers on ``device``."""
    root = tmp / "archs" / arch
    ckpt = write_tiny_checkpoint(root / f"tiny-{arch}", arch=arch)
    tok = HFTokenizer.from_dir(ckpt)
    ref = Reference(ckpt, device)
    prompts, expected = reference_turns(ref, tok)
    want = [_visible(tok.decode(e)) for e in expected]
    main_label = "cuda (dry run: cpu)" if device == "cpu" else device
    texts = {}
    for i, (label, dev) in enumerate([(main_label, device), ("cpu", "cpu")]):
        work = root / f"serve-{i}"
        work.mkdir(parents=True)
        kv = work / "kv"  # a store per server: each turn 1 is a miss
        args = [f"--model-dir={ckpt}", f"--device={dev}", f"--block-tokens={BLOCK_TOKENS}"]
        name = f"{arch} serve --device {label}"
        texts[label] = check_server(
            name, [*args, f"--kv-root={kv}"], work, tmp / "pids", prompts, report
        )

    def why(t: int, got: str) -> str:
        where = f"conversation {t // 2 + 1} turn {t % 2 + 1}"
        return f"{where}: {explain(ref, tok, prompts[t], expected[t], got)}"

    # byte tokens that are not whole UTF-8 decode to U+FFFD: text cannot tell them apart
    blind = sum("\ufffd" in tok.decode([i]) or not tok.decode([i]) for e in expected for i in e)
    same = (
        f"{len(prompts)} replies x {NEW_TOKENS} tokens, equal as text ({blind} of them lone"
        " bytes, which text cannot tell apart)"
    )
    main, cpu = texts[main_label], texts["cpu"]
    name = f"{arch} greedy tokens: {main_label} server == cpu server"
    if main is None or cpu is None:
        report.check(False, name, "a server gave no replies (above)")
    else:
        diffs = [
            f"{main_label}: {why(t, main[t])}; cpu: {why(t, cpu[t])}"
            for t in range(len(prompts))
            if main[t] != cpu[t]
        ]
        report.check(not diffs, name, _first(diffs) or same)
    name = f"{arch} greedy tokens: {main_label} server == transformers generate on {device}"
    if main is None:
        report.check(False, name, "the server gave no replies (above)")
    else:
        diffs = [why(t, main[t]) for t in range(len(prompts)) if main[t] != want[t]]
        report.check(not diffs, name, _first(diffs) or same)


AGENT_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}


def _post(url: str, body: dict[str, object]) -> dict[str, Any]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as resp:
        return dict(json.load(resp))


def check_agent_api(tmp: Path, device: str, report: Report) -> None:
    """Constrained decoding on ``device`` (the grammar mask on the engines' logits): a forced
    tool call and a json_schema reply validate against their schemas; logprobs come back."""
    import jsonschema

    root = tmp / "agent"
    ckpt = write_tiny_checkpoint(root / "tiny-llama", arch="llama")
    work = root / "serve"
    work.mkdir(parents=True)
    args = [f"--model-dir={ckpt}", f"--device={device}", f"--kv-root={work / 'kv'}"]
    server = Server(args, work / "serve.log", tmp / "pids")
    name = f"agent API on {device}: forced tool call + json_schema + logprobs"
    try:
        server.wait_ready()
        url = server.url + "/v1/chat/completions"
        ask = [{"role": "user", "content": "Weather in Paris?"}]
        tool = {"type": "function", "function": {"name": "weather", "parameters": AGENT_SCHEMA}}
        r = _post(
            url,
            {
                "messages": ask,
                "tools": [tool],
                "tool_choice": "required",
                "max_tokens": 120,
                "temperature": 0,
                "logprobs": True,
                "top_logprobs": 2,
            },
        )
        call = r["choices"][0]["message"]["tool_calls"][0]["function"]
        jsonschema.validate(json.loads(call["arguments"]), AGENT_SCHEMA)
        lps = r["choices"][0]["logprobs"]["content"]
        fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": AGENT_SCHEMA}}
        j = _post(
            url,
            {
                "messages": ask,
                "response_format": fmt,
                "max_tokens": 80,
                "temperature": 1.0,
                "seed": 3,
            },
        )
        jsonschema.validate(json.loads(j["choices"][0]["message"]["content"]), AGENT_SCHEMA)
        report.check(bool(lps), name, f"call {call['arguments']}, {len(lps)} logprobs")
    except Exception as e:  # one failed check, reported with the server log
        report.check(False, name, f"{type(e).__name__}: {e}\n{server.log_tail()}")
    finally:
        server.stop()


def check_cuda_tests(dry_run: bool, report: Report) -> None:
    name = f"pytest {PYTEST_ARGS}"
    cmd = [sys.executable, "-m", "pytest", "-rs", "-p", "no:cacheprovider", *PYTEST_ARGS.split()]
    try:
        run = subprocess.run(
            cmd, cwd=REPO, capture_output=True, text=True, timeout=PYTEST_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        report.check(False, name, f"ran past {PYTEST_TIMEOUT_S:.0f} s")
        return
    summary = (run.stdout.strip().splitlines() or ["(no output)"])[-1]
    skipped = " skipped" in summary
    ok = run.returncode == 0 and (dry_run or not skipped)
    detail = summary + (" (dry run: no CUDA, skips expected)" if dry_run and skipped else "")
    if not ok:
        detail += "\n" + "\n".join("    | " + line for line in run.stdout.splitlines()[-20:])
    report.check(ok, name, detail)


VLLM_TEST = "tests/integrations/test_vllm_e2e.py"  # DualPath inside vLLM, end to end
VLLM_TIMEOUT_S = 900.0


def check_vllm(device: str, report: Report) -> None:
    """``serve --engine vllm`` (the DualPath connector in vLLM prefill and decode instances,
    behind the router) against one plain vLLM instance, on ``device``: the end-to-end test
    with ``DUALPATH_VLLM_TEST_DEVICE``. Where no vLLM is installed (its CUDA build on a GPU
    machine, ``.venv-vllm`` on CPU) one SKIP line, not a failure."""
    from dualpath.integrations.vllm.launch import find_vllm_python

    name = f"vLLM + DualPath connector on {device} ({VLLM_TEST})"
    try:
        python = find_vllm_python()
    except ValueError as err:
        print(f"SKIP {name}: {err}", flush=True)
        return
    env = {**os.environ, "DUALPATH_VLLM_TEST_DEVICE": device, "DUALPATH_VLLM_PYTHON": python}
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", VLLM_TEST]
    try:
        run = subprocess.run(
            cmd, cwd=REPO, capture_output=True, text=True, env=env, timeout=VLLM_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        report.check(False, name, f"ran past {VLLM_TIMEOUT_S:.0f} s")
        return
    summary = (run.stdout.strip().splitlines() or ["(no output)"])[-1]
    detail = summary
    if run.returncode:
        detail += "\n" + "\n".join("    | " + line for line in run.stdout.splitlines()[-25:])
    report.check(run.returncode == 0 and "passed" in summary, name, detail)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tmp", type=Path, required=True, help="scratch dir (the caller removes it)")
    p.add_argument("--dry-run", action="store_true", help="run every cuda step on cpu")
    p.add_argument("--archs", default=",".join(ARCHS), help="comma-separated subset of ARCHS")
    p.add_argument("--skip-vllm", action="store_true", help="leave out the vLLM section")
    opts = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout`: run the finally blocks

    if not opts.dry_run and not torch.cuda.is_available():
        print(
            f"no CUDA device available (torch {torch.__version__}, CUDA build "
            f"{torch.version.cuda}): nothing to check; --dry-run runs the flow on cpu"
        )
        return 2
    device = "cpu" if opts.dry_run else "cuda"
    name = torch.cuda.get_device_name(0) if device == "cuda" else "none (dry run: cpu)"
    print(f"torch {torch.__version__}, CUDA device: {name}", flush=True)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    transformers.utils.logging.disable_progress_bar()
    (opts.tmp / "pids").mkdir(parents=True, exist_ok=True)

    report = Report()
    for arch in opts.archs.split(","):
        try:
            check_arch(arch, opts.tmp, device, report)
        except Exception:  # a broken step fails its architecture, not the whole check
            report.check(False, f"{arch} check", traceback.format_exc(limit=-4))
    check_agent_api(opts.tmp, device, report)
    check_cuda_tests(opts.dry_run, report)
    if not opts.skip_vllm:
        check_vllm(device, report)
    failed = ", ".join(report.failed)
    print(
        f"== checks: {report.num_passed} passed, {len(report.failed)} failed"
        + (f" ({failed})" if failed else "")
    )
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
