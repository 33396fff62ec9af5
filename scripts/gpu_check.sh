#!/usr/bin/env bash
# GPU check: the CUDA tests of the HF model (our forward on cuda vs cpu, plus the transformers
# comparisons on the same machine), then, if fastapi/uvicorn are installed, a short
# `dualpath serve --device cuda` smoke (tiny random Llama written locally, one chat request,
# SIGTERM). Needs python3 with torch (CUDA), transformers, safetensors, tokenizers, pytest.
# Run from the repository root:  bash scripts/gpu_check.sh   (exit 0: everything run passed)
# DEVICE=cpu bash scripts/gpu_check.sh  dry-runs the same steps on a machine without a GPU.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda}
status=0

echo "== environment"
DEVICE=$DEVICE $PY - <<'PYEOF' || exit 2
import os, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if os.environ["DEVICE"] == "cuda":
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device visible: nothing to check")
    print("device", torch.cuda.get_device_name(0))
PYEOF

echo "== tests/runtime/test_hf_model.py (the CUDA test must run, not skip)"
# -o addopts= : the repo's addopts are fine, but pytest-timeout may be missing here
out=$(timeout 600 $PY -m pytest -q -rs -p no:cacheprovider -o addopts="--import-mode=importlib" \
      tests/runtime/test_hf_model.py 2>&1)
rc=$?
echo "$out" | tail -25
if [ $rc -ne 0 ]; then status=1; fi
if [ "$DEVICE" = cuda ] && echo "$out" | grep -q "SKIPPED.*needs a CUDA device"; then
  echo "FAIL: the CUDA test was skipped"; status=1
fi

echo "== serve --device $DEVICE smoke"
if ! $PY -c "import fastapi, uvicorn, jinja2, prometheus_client" 2>/dev/null; then
  echo "skipped: fastapi / uvicorn / jinja2 / prometheus_client not installed"
else
  tmp=$(mktemp -d)
  port=18765
  $PY -m dualpath.cli.main serve --model-dir "$tmp/tiny-llama" --init-tiny-checkpoint \
      --device "$DEVICE" --port $port > "$tmp/serve.log" 2>&1 &
  pid=$!
  timeout 300 $PY - "$port" <<'PYEOF'
import json, sys, time, urllib.request
url = f"http://127.0.0.1:{sys.argv[1]}"
deadline = time.monotonic() + 240
while True:
    try:
        urllib.request.urlopen(url + "/health", timeout=2)
        break
    except OSError:
        if time.monotonic() > deadline:
            raise SystemExit("server did not become ready")
        time.sleep(0.5)
body = {"messages": [{"role": "user", "content": "Hello from the GPU check."}],
        "max_tokens": 16, "temperature": 0, "ignore_eos": True}
req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                             {"content-type": "application/json"})
t0 = time.monotonic()
r = json.load(urllib.request.urlopen(req, timeout=120))
t1 = time.monotonic()
u = r["usage"]
assert u["completion_tokens"] == 16, u
second = json.load(urllib.request.urlopen(req, timeout=120))
assert second["choices"][0]["message"] == r["choices"][0]["message"], "greedy not repeatable"
print(f"ok: 16 tokens in {t1 - t0:.3f} s; cached on resend:",
      second["usage"]["prompt_tokens_details"]["cached_tokens"])
PYEOF
  rc=$?
  kill -TERM $pid 2>/dev/null
  wait $pid; src=$?
  tail -5 "$tmp/serve.log"
  if [ $rc -ne 0 ] || [ $src -ne 0 ]; then echo "FAIL: smoke rc=$rc, server exit=$src"; status=1; fi
  rm -rf "$tmp"
fi
echo "== gpu_check: $([ $status -eq 0 ] && echo PASSED || echo FAILED)"
exit $status
