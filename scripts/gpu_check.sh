#!/usr/bin/env bash
# GPU check of the runtime on real model architectures. For tiny random Llama, Qwen2 and Qwen3 checkpoints written to a
# temp dir, `dualpath serve --device cuda` (the DualPath runtime: scheduler, storage workers,
# PE and DE processes) must give the same greedy tokens, on a first turn and on a second turn
# that re-sends prompt + output (cached_tokens > 0), as the same server on --device cpu and as
# transformers' `generate` on CUDA (float32); a mismatch is a FAIL naming the first differing
# token and the reference's logit gap there. Then `pytest tests/runtime/test_hf_model.py -k cuda`,
# and DualPath inside vLLM (tests/integrations/test_vllm_e2e.py on the device; a SKIP line where
# no vLLM is installed: its CUDA build on a GPU machine, .venv-vllm here).
# The steps live in scripts/gpu_check.py; this script owns the venv check, the temp dir, the
# time limit and the cleanup (every server process group, the temp dir), on exit or signal.
#
#   scripts/gpu_check.sh            on a machine with a CUDA device
#   scripts/gpu_check.sh --dry-run  the same flow with every cuda step on cpu (CUDA tests skip),
#                                   for a machine without one; or GPU_CHECK_DRY_RUN=1
# Run from anywhere (it cd's to the repository root); needs .venv (`make test` makes it).
# Prints one PASS/FAIL line per check and a summary. Exit: 0 every check passed; 1 a check
# failed or ran past its limit; 2 no CUDA device available (and no dry run); 3 no .venv; 64 bad
# usage. Limits: each server start 180 s, each request 120 s, pytest 300 s, and all the steps
# together GPU_CHECK_TIMEOUT_S (default 900 s; a dry run takes about 5 minutes on 2 cores, 3.5
# of them the vLLM section).
set -u
cd "$(dirname "$0")/.."

dry_run=${GPU_CHECK_DRY_RUN:-0}
for arg in "$@"; do
  case $arg in
    --dry-run) dry_run=1 ;;
    -h|--help) sed -n '2,18s/^# \{0,1\}//p' "$0"; exit 0 ;;
    *) echo "gpu_check: unknown argument $arg (try --help)" >&2; exit 64 ;;
  esac
done
if [ ! -x .venv/bin/python ]; then
  echo "gpu_check: no .venv in $(pwd): run \`make test\` first to create it"
  exit 3
fi

tmp=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
child=
cleanup() {
  if [ -n "$child" ]; then
    # `timeout` leads its own process group, gpu_check.py in it: TERM lets it stop its servers
    kill -TERM -- "-$child" 2>/dev/null
    for _ in $(seq 40); do kill -0 -- "-$child" 2>/dev/null && sleep 1; done
    kill -KILL -- "-$child" 2>/dev/null
  fi
  # a server still running (gpu_check.py was killed): its file is named by its pid, which is
  # also its process group's id (each server has its own session)
  for pid_file in "$tmp"/pids/*; do
    [ -e "$pid_file" ] && kill -KILL -- "-$(basename "$pid_file")" 2>/dev/null
  done
  rm -rf "$tmp"
}
trap cleanup EXIT
trap 'echo; echo "gpu_check: interrupted"; exit 130' INT
trap 'exit 143' TERM

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1  # everything is local; never wait on a network
limit_s=${GPU_CHECK_TIMEOUT_S:-900}
flags=()
[ "$dry_run" = 1 ] && flags+=(--dry-run) && echo "== gpu_check: DRY RUN, every cuda step on cpu"
started=$SECONDS
# in the background, so that a signal interrupts the wait and reaches the trap at once
timeout -k 20 "$limit_s" .venv/bin/python scripts/gpu_check.py --tmp "$tmp" "${flags[@]}" &
child=$!
wait "$child"
rc=$?
kill -0 -- "-$child" 2>/dev/null || child=  # gpu_check.py can outlive a killed `timeout`
case $rc in
  0) verdict=PASSED ;;
  1) verdict=FAILED ;;
  2) verdict="NOT RUN (no CUDA device)" ;;
  124) echo "FAIL gpu_check.py ran past ${limit_s} s (GPU_CHECK_TIMEOUT_S)"; rc=1 verdict=FAILED ;;
  137) echo "FAIL gpu_check.py was killed (SIGKILL)"; rc=1 verdict=FAILED ;;
  *) echo "FAIL gpu_check.py exited with $rc"; rc=1 verdict=FAILED ;;
esac
echo "== gpu_check: $verdict in $((SECONDS - started)) s"
exit $rc
