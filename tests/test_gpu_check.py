"""scripts/gpu_check.sh without a GPU: it must still run and say, in its one JSON line, why."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_without_a_gpu_prints_one_json_summary() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: scripts/gpu_check.sh runs the real checks")
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--python", sys.executable],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1
    summary = json.loads(lines[0])
    assert summary["gpu"] is None and summary["ok"] is True
    assert "no CUDA device" in summary["skipped"]


def test_gpu_check_rejects_unknown_options() -> None:
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--bogus"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "unknown option --bogus" in done.stderr
