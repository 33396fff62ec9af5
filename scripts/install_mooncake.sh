#!/usr/bin/env bash
# Optional: the Mooncake Transfer Engine backend needs the system library libibverbs1.
# Installs it where we can (root with apt), then the PyPI wheel. Never fails the build:
# tests that need Mooncake skip with a clear message when it is unavailable.
PIP=${1:-pip}
if ! ldconfig -p 2>/dev/null | grep -q libibverbs.so.1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get install -y -q libibverbs1 >/dev/null 2>&1 \
      || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libibverbs1 >/dev/null 2>&1)) \
      || echo "note: could not install libibverbs1; Mooncake transport tests will skip"
  else
    echo "note: libibverbs1 missing and not root; Mooncake transport tests will skip"
  fi
fi
"$PIP" install -q mooncake-transfer-engine-non-cuda 2>/dev/null \
  || echo "note: mooncake-transfer-engine-non-cuda not installed; Mooncake transport tests will skip"
exit 0
