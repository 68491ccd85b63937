"""``kvtier demo`` as a user runs it: bad options are one-line errors (exit 2, no traceback),
each mode's options are refused by the other, the NVMe directory is removed even when a run
fails, and piped output keeps whole lines."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.cli.main import main

# the transformers mode (the default is vLLM when it is installed: tests/test_vllm_demo.py)
SMALL = [
    "--engine",
    "hf",
    "--sessions",
    "2",
    "--turns",
    "2",
    "--doc-tokens",
    "200",
    "--new-tokens",
    "2",
]

BAD = [
    (["--sessions", "0"], "--sessions must be >= 1, got 0"),
    (["--sessions", "-1"], "--sessions must be >= 1, got -1"),
    (["--turns", "0"], "--turns must be >= 1, got 0"),
    (["--turns", "-2"], "--turns must be >= 1, got -2"),
    (["--new-tokens", "0"], "--new-tokens must be >= 1, got 0"),
    (["--host-blocks", "0"], "--host-blocks must be >= 1, got 0"),
    (["--doc-tokens", "-500"], "--doc-tokens must be >= 0, got -500"),
    (["--doc-tokens", "-5"], "--doc-tokens must be >= 0, got -5"),
    (["--seed", "-1"], "--seed must be >= 0, got -1"),
    (["--synthetic", "--seed", "-1"], "--seed must be >= 0, got -1"),
    (["--synthetic", "--scale", "0"], "--scale must be a finite number > 0, got 0.0"),
    (["--synthetic", "--scale", "-2"], "--scale must be a finite number > 0, got -2.0"),
    (["--synthetic", "--scale", "nan"], "--scale must be a finite number > 0, got nan"),
    (["--synthetic", "--host", "lots"], "--host: cannot read size 'lots'"),
    (["--warm"], "--warm applies to --synthetic only; add --synthetic"),
    (["--host", "8MiB"], "--host applies to --synthetic only; add --synthetic"),
    (["--nvme", "1GiB"], "--nvme applies to --synthetic only; add --synthetic"),
    (["--scale", "2"], "--scale applies to --synthetic only; add --synthetic"),
    (["--layers", "2"], "--layers applies to --synthetic only; add --synthetic"),
    (["--synthetic", "--sessions", "2"], "--sessions applies to the real-model demo, not"),
    (["--synthetic", "--model", "x"], "--model applies to the real-model demo, not --synthetic"),
    (["--service"], "--service/--no-service apply to the vLLM demo (engines sharing kvtier"),
    (["--synthetic", "--no-service"], "--service/--no-service apply to the vLLM demo, not"),
    (["--model", "{nomt}"], "cannot load a causal LM from {nomt}: Unrecognized model"),
    (["--model", "{tmp}/nothing"], "is not a checkpoint directory (no config.json)"),
]


@pytest.mark.parametrize(("flags", "needle"), BAD)
def test_bad_demo_option_is_a_one_line_error(
    flags: list[str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if "--synthetic" not in flags:
        pytest.importorskip("transformers")
    nomt = tmp_path / "nomt"  # a checkpoint whose config.json has no model_type
    nomt.mkdir()
    (nomt / "config.json").write_text('{"hidden_size": 8}')
    fill = {"nomt": str(nomt), "tmp": str(tmp_path)}
    args = [f.format(**fill) for f in flags]
    if (
        "--synthetic" not in flags
        and "--warm" not in flags
        and all(
            not f.startswith(("--host", "--nvme", "--scale", "--layers")) or f == "--host-blocks"
            for f in flags
        )
    ):
        args = ["--engine", "hf", *args]
    rc = main(["demo", "--dir", str(tmp_path / "d"), *args])
    out, err = capsys.readouterr()
    assert rc == 2 and "Traceback" not in err, err
    assert needle.format(**fill) in err and err.count("\n") == 1, err
    assert out == ""  # refused before anything ran
    assert not (tmp_path / "d" / "hf").exists()


def test_failed_model_demo_removes_its_nvme_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("transformers")
    from kvtier.integrations import hf

    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(hf, "generate_with_cache", boom)
    with pytest.raises(RuntimeError, match="boom"):
        main(["demo", "--dir", str(tmp_path), *SMALL])
    assert not (tmp_path / "hf").exists()


def test_piped_model_demo_keeps_whole_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not a terminal: turn lines are not wrapped and the summary's headers are not cut."""
    pytest.importorskip("transformers")
    rc = main(["demo", "--dir", str(tmp_path), *SMALL, "--host-blocks", "6"])
    out = capsys.readouterr().out
    assert rc == 0, out
    turns = [line for line in out.splitlines() if line.startswith("session ")]
    assert len(turns) == 4 and all(line.endswith("without kvtier; identical") for line in turns)
    assert "warm-up forward" in out and "all identical" in out and "…" not in out
    assert out.rstrip().endswith("all 4 turns bit-identical to a plain run")
    assert not (tmp_path / "hf").exists()
