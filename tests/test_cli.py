"""The command line as a user runs it (in-process, through ``main``)."""

from __future__ import annotations

import json

import pytest

from kvtier.cli.main import main


def test_plan_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "plan",
                "--model",
                "Llama-3.1-8B",
                "--dtype",
                "bf16",
                "--context-tokens",
                "32768",
                "--requests",
                "4",
                "--json",
            ]
        )
        == 0
    )
    d = json.loads(capsys.readouterr().out)
    assert d["kv_bytes_per_token"] == 131072
    assert d["kv_bytes_total"] == 131072 * 32768 * 4
    assert isinstance(d["kv_bytes_total"], int)


def test_plan_manual_shape_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "plan",
                "--layers",
                "61",
                "--kv-heads",
                "1",
                "--head-dim",
                "576",
                "--kv-factor",
                "1",
                "--dtype",
                "fp8",
                "--json",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["kv_bytes_per_token"] == 61 * 576
    assert main(["plan", "--layers", "2"]) == 2
    assert "give --model" in capsys.readouterr().err
    assert main(["plan", "--model", "nope"]) == 2


def test_synthetic_demo_runs_and_verifies(
    tmp_path: object, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(
        [
            "demo",
            "--synthetic",
            "--scale",
            "0.25",
            "--host",
            "8MiB",
            "--nvme",
            "32MiB",
            "--dir",
            str(tmp_path),
            "--layers",
            "2",
            "--head-dim",
            "32",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "matched a recomputation" in out and "per tier" in out


def test_model_demo_is_the_default(tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    rc = main(
        [
            "demo",
            "--dir",
            str(tmp_path),
            "--sessions",
            "2",
            "--turns",
            "2",
            "--doc-tokens",
            "200",
            "--new-tokens",
            "2",
            "--host-blocks",
            "6",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "real model" in out and "identical" in out and "DIFFERENT" not in out


def test_bench_dispatches_to_one_target(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "sim", "--json", "--rounds", "1"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["requests"] == 3993 and 0 < d["token_hit_ratio"] < 1
