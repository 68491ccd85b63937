#!/usr/bin/env bash
# Set up everything the tests need (idempotent) and run them: lint, types, the test suite.
# Servers (redis-server, a Redis Cluster, mooncake_master, an S3-protocol server) are started by
# the test fixtures on 127.0.0.1 and stopped by PID when the session ends.
set -euo pipefail
cd "$(dirname "$0")/.."
need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
ldconfig -p 2>/dev/null | grep -q libibverbs.so.1 || need+=(libibverbs1)
command -v fio >/dev/null 2>&1 || need+=(fio)  # kvtier bench disk's raw limit
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
  else
    echo "warning: missing ${need[*]}; server tests will be skipped (run as root to install)" >&2
  fi
fi
bash scripts/setup.sh
.venv/bin/ruff check kvtier tests
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/python -m pytest -m "not slow" "$@"
