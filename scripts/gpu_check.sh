#!/usr/bin/env bash
# The checks that need a GPU, in one run (<= 8 minutes on one GPU), ending in ONE JSON object
# on stdout (everything else goes to stderr):
#   1. the GPU-marked tests (pytest -m gpu);
#   2. `kvtier bench vllm` on the GPU: kvtier against plain vLLM (recompute) and, with
#      --offload, vLLM's own CPU offloading (kv_offloading_size) in the same run.
# On a machine without a CUDA device (or without vLLM) each part says why it was skipped; the
# script still exits 0 and prints the summary, so its CPU parts are tested everywhere
# (tests/test_gpu_check.py). Exit status 1 when a part that ran failed.
# Usage: scripts/gpu_check.sh [--python PATH] [--bench-args "..."]
set -uo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
bench_args="--doc 8192 --docs 3 --repeat 3 --offload"
while [ $# -gt 0 ]; do
  case "$1" in
    --python) py="$2"; shift 2 ;;
    --bench-args) bench_args="$2"; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
[ -x "$py" ] || py=$(command -v python3)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
gpu=$("$py" -c 'import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")' 2>/dev/null || true)
echo "{}" >"$out/bench.json"
tests_rc=-1
bench_rc=-1
if [ -n "$gpu" ]; then
  timeout 240 "$py" -m pytest -q -m gpu -p no:cacheprovider --junitxml="$out/gpu.xml" >&2
  tests_rc=$?
  if "$py" -c 'import vllm' 2>/dev/null; then
    # shellcheck disable=SC2086  # bench_args is a list of options
    timeout 300 "$py" -m kvtier.cli.main bench vllm --json $bench_args >"$out/bench.json"
    bench_rc=$?
  fi
fi
GPU="$gpu" TESTS_RC=$tests_rc BENCH_RC=$bench_rc OUT="$out" "$py" - <<'PY'
import json, os, xml.etree.ElementTree as ET
out, gpu = os.environ["OUT"], os.environ["GPU"]
tests_rc, bench_rc = int(os.environ["TESTS_RC"]), int(os.environ["BENCH_RC"])
summary = {"gpu": gpu or None}
if not gpu:
    summary["skipped"] = "no CUDA device (torch.cuda.is_available() is false)"
else:
    try:
        suite = ET.parse(os.path.join(out, "gpu.xml")).getroot()
        suite = suite if suite.tag == "testsuite" else suite[0]
        summary["gpu_tests"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    except (OSError, ET.ParseError, IndexError):
        summary["gpu_tests"] = {"error": f"pytest exited {tests_rc} without a report"}
    if bench_rc == -1:
        summary["bench_vllm"] = {"skipped": "vLLM is not importable"}
    else:
        try:
            text = open(os.path.join(out, "bench.json")).read()
            summary["bench_vllm"] = json.loads(text.strip().splitlines()[-1])
        except (OSError, ValueError, IndexError):
            summary["bench_vllm"] = {"error": f"kvtier bench vllm exited {bench_rc}"}
summary["ok"] = tests_rc in (-1, 0, 5) and bench_rc in (-1, 0)
print(json.dumps(summary))
raise SystemExit(0 if summary["ok"] else 1)
PY
