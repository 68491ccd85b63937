#!/usr/bin/env bash
# Set up kvtier in .venv/ (idempotent): the package with every extra the demo and tests use.
# torch is pinned to the CPU build this machine kind ships (a bare `pip install torch` would
# pull a multi-GB CUDA build). The install compiles the simulator's hot modules with mypyc
# (setup.py; pure Python without a C compiler or with KVTIER_PURE=1) and is redone when a
# compiled module's source changed since (kvtier/_native.py).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
stamp=.venv/.kvtier-setup
stale() {
  ! .venv/bin/python -c 'import sys, kvtier._native as n; sys.exit(bool(n.Build.read().stale()))' \
    >/dev/null 2>&1
}
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ setup.py -nt "$stamp" ] || stale; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e '.[hf,redis,s3,crypto,mooncake,service,dev]'
  .venv/bin/python -c 'import kvtier._native as n; n.compiled() or print("note: kvtier is pure" \
    " Python here (KVTIER_PURE set, or compiling failed: pip install -v -e . says why)")'
  touch "$stamp"
fi
