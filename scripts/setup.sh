#!/usr/bin/env bash
# Set up kvtier in .venv/ (idempotent): the package with every extra the demo and tests use.
# torch is pinned to the CPU build this machine kind ships (a bare `pip install torch` would
# pull a multi-GB CUDA build). kvtier is pure Python: no compiler is needed.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
stamp=.venv/.kvtier-setup
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e '.[hf,redis,s3,crypto,mooncake,service,dev]'
  touch "$stamp"
fi
