"""The command line as a user runs it (in-process, through ``main``)."""

from __future__ import annotations

import json
from pathlib import Path

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
            "--engine",  # the transformers mode; through vLLM: tests/test_vllm_demo.py
            "hf",
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
    assert d["heap_bytes_per_block"] > 0  # the index and the policy hold something per block


# --- bad input: one line naming the problem, exit status 2, no traceback, nothing written ---

TOML_CASES = [
    ('[gpu]\nflops = "abc"', "[gpu] flops must be a finite number > 0, got 'abc'"),
    ("[gpu]\nflops = 0", "[gpu] flops must be a finite number > 0, got 0"),
    ('[gpu]\ncount = "x"', "[gpu] count must be a positive integer, got 'x'"),
    ("[gpu]\ncount = 0", "[gpu] count must be a positive integer, got 0"),
    ("[gpu]\ncount = 2.7", "[gpu] count must be a positive integer, got 2.7"),
    ("[gpu]\nmfu = 0", "[gpu] mfu must be in (0, 1]"),
    ("[gpu]\nmfu = -1", "[gpu] mfu must be in (0, 1]"),
    ("[gpu]\nmfu = nan", "[gpu] mfu must be in (0, 1]"),
    ("[gpu]\nwatts = -5", "[gpu] watts must be a finite number >= 0, got -5"),
    ("gpu = 5", "'gpu' must be a table"),
    ("tiers = 5", "'tiers' must be an array of tables"),
    ("tiers = [5]", "'tiers' must be an array of tables"),
    ("model = 5", "model must be a non-empty string, got 5"),
    ('policy = "nope"', "policy 'nope' is unknown"),
    (
        '[[tiers]]\nname = "dram"\ncapacity = "1TB"\nbandwidth = 0',
        "[[tiers]] #1 ('dram') bandwidth must be > 0",
    ),
    (
        '[[tiers]]\nname = "dram"\ncapacity = "1TB"\nlatency_us = inf',
        "[[tiers]] #1 ('dram') latency_us must be a finite number >= 0",
    ),
    (
        '[[tiers]]\nname = "dram"\ncapacity = "1TB"\n[[tiers]]\nname = "dram"\ncapacity = "2TB"',
        "[[tiers]]: tier 'dram' is given twice",
    ),
    (
        '[[tiers]]\nname = "nvme"\ncapacity = "1TB"\n[[tiers]]\nname = "hbm"\ncapacity = "1GB"',
        "[[tiers]]: tier 'hbm' comes after 'nvme'; list tiers fastest first, in the order hbm",
    ),
    (
        '[[tiers]]\nname = "tape"\ncapacity = "1TB"',
        "[[tiers]] #1 ('tape'): tier 'tape' has no default",
    ),
    ("cluster = 4", "'cluster' must be a table ([cluster] with nodes, route)"),
    ("[cluster]\nnodes = 0", "[cluster] nodes must be a positive integer, got 0"),
    ('[cluster]\nnodes = "4"', "[cluster] nodes must be a positive integer, got '4'"),
    ('[cluster]\nroute = "hash"', "[cluster] route 'hash' is unknown; choose rr, prefix, cache"),
    ("[cluster]\nracks = 2", "[cluster] unknown key(s) racks; allowed: nodes, route"),
]


TOML_IDS = [
    "flops-str",
    "flops-0",
    "count-str",
    "count-0",
    "count-float",
    "mfu-0",
    "mfu-neg",
    "mfu-nan",
    "watts-neg",
    "gpu-int",
    "tiers-int",
    "tiers-list-int",
    "model-int",
    "policy",
    "bandwidth-0",
    "latency-inf",
    "dup-tier",
    "order",
    "custom-no-bandwidth",
    "cluster-int",
    "nodes-0",
    "nodes-str",
    "route-unknown",
    "cluster-key",
]


@pytest.mark.parametrize(
    ("toml", "needle"),
    [pytest.param(t, n, id=i) for i, (t, n) in zip(TOML_IDS, TOML_CASES, strict=True)],
)
def test_simulate_bad_toml_is_a_clear_error(
    toml: str, needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(toml)
    rc = main(["simulate", "--synthetic", "chat", "--requests", "20", "--config", str(cfg)])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert f"{cfg}: {needle}" in err


def _traces(tmp: Path) -> dict[str, Path]:
    good = '{"timestamp": 5, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}\n'
    files = {
        "binary": b"\x9a\xff\x00\x01T\xe9:jg\n" + good.encode(),
        "late_bad_utf8": good.encode() * 2 + b'{"timestamp": 1, "x": "\xff"}\n',
        "nan_ts": b'{"timestamp": NaN, "input_length": 10, "hash_ids": [1]}\n',
        "inf_ts": b'{"timestamp": Infinity, "input_length": 10, "hash_ids": [1]}\n',
        "no_length": b'{"timestamp": 1, "hash_ids": [1]}\n',
        "no_ids": b'{"timestamp": 1, "input_length": 10}\n',
        "bom": b"\xef\xbb\xbf" + good.encode(),
        "backwards": (good + good.replace('"timestamp": 5', '"timestamp": 1')).encode(),
        "afile": b"not a directory\n",
    }
    out = {}
    for name, data in files.items():
        out[name] = tmp / f"{name}.jsonl"
        out[name].write_bytes(data)
    return out


FLAG_CASES = [
    (["--trace", "{binary}"], "binary.jsonl:1: not UTF-8 text (byte 0x9a at column 1)"),
    (["--trace", "{late_bad_utf8}"], "late_bad_utf8.jsonl:3: not UTF-8 text (byte 0xff"),
    (["--trace", "{nan_ts}"], "nan_ts.jsonl:1: 'timestamp' must be a finite"),
    (["--trace", "{inf_ts}"], "inf_ts.jsonl:1: 'timestamp' must be a finite"),
    (["--trace", "{no_length}"], "no_length.jsonl:1: 'input_length' is missing"),
    (["--trace", "{no_ids}"], "no_ids.jsonl:1: 'hash_ids' is missing"),
    (["--sweep", "--capacities", "a,b"], "--capacities 'a,b': 'a' is not a whole number"),
    (["--sweep", "--capacities", "1,,2"], "--capacities '1,,2': an empty item"),
    (["--sweep", "--capacities", "1.5"], "--capacities '1.5': '1.5' is not a whole number"),
    (["--sweep", "--capacities", ""], "--capacities is empty"),
    (["--sweep", "--capacities", "0,10,5,5"], "capacities are blocks >= 1, got 0"),
    (["--capacities", "10"], "--capacities sets the sweep's capacities; add --sweep"),
    (["--jobs", "2"], "--jobs sets how many replays of the sweep run at once; add --sweep"),
    (["--sweep", "--jobs", "0"], "--jobs must be >= 1, got 0"),
    (["--gpus", "0"], "--gpus must be >= 1, got 0"),
    (["--gpus", "-1"], "--gpus must be >= 1, got -1"),
    (["--policy", "nope"], "--policy 'nope' is unknown"),
    (["--tier", "dram=1TB", "--tier", "dram=1TB"], "--tier: tier 'dram' is given twice"),
    (["--tier", "nvme=1TB", "--tier", "hbm=1GB"], "--tier: tier 'hbm' comes after 'nvme'"),
    (["--tier", "dram=1KiB"], "tier 'dram': capacity 1,024 bytes is less than one block"),
    (["--save-trace", "{tmp}/nope/t.jsonl"], "/nope' does not exist"),
    (["--save-trace", "{tmp}"], "is a directory; give a file name"),
    (["--plot", "{afile}"], "exists and is not a directory"),
    (["--plot", "{afile}/sub"], "afile.jsonl' is a file"),
    (["--config", "{binary}"], "binary.jsonl': not UTF-8 text"),
]


@pytest.mark.parametrize(("flags", "needle"), FLAG_CASES)
def test_simulate_bad_flag_or_trace_is_a_clear_error(
    flags: list[str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    names = {k: str(v) for k, v in _traces(tmp_path).items()}
    args = [f.format(tmp=tmp_path, **names) for f in flags]
    src = [] if "--trace" in args else ["--synthetic", "chat", "--requests", "20"]
    rc = main(["simulate", *src, *args])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert needle in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "sim", "--trace", "{binary}", "--rounds", "1"],
        ["plan", "--trace", "{binary}", "--slo-ttft-p90", "1"],
        ["bench", "sim", "--rounds", "0"],
        ["bench", "sim", "--rounds", "-1"],
    ],
)
def test_other_trace_commands_give_clear_errors(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    names = {k: str(v) for k, v in _traces(tmp_path).items()}
    rc = main([a.format(**names) for a in argv])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert ("not UTF-8 text" in err) if "--trace" in argv else ("--rounds must be >= 1" in err)


def test_bom_and_backwards_timestamps_are_accepted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = _traces(tmp_path)
    for name in ("bom", "backwards"):
        assert main(["simulate", "--trace", str(files[name]), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["input_tokens"] > 0


def test_failing_run_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = _traces(tmp_path)["backwards"]
    before = trace.read_bytes()
    plots = tmp_path / "plots"
    for extra in (["--model", "nope"], []):  # a bad model, then an otherwise valid run
        argv = ["simulate", "--trace", str(trace), "--save-trace", str(trace), *extra]
        assert main([*argv, "--plot", str(plots)]) == 2
        assert "Traceback" not in capsys.readouterr().err
        assert trace.read_bytes() == before and not plots.exists()
    alias = tmp_path / "sub" / ".." / trace.name
    (tmp_path / "sub").mkdir()
    assert main(["simulate", "--trace", str(trace), "--save-trace", str(alias)]) == 2
    assert "is the input trace" in capsys.readouterr().err and trace.read_bytes() == before
    saved = tmp_path / "saved.jsonl"
    assert (
        main(
            [
                "simulate",
                "--synthetic",
                "chat",
                "--requests",
                "20",
                "--model",
                "nope",
                "--save-trace",
                str(saved),
            ]
        )
        == 2
    )
    assert not saved.exists() and not list(tmp_path.glob(".saved*"))


def test_sweep_rows_do_not_depend_on_jobs(capsys: pytest.CaptureFixture[str]) -> None:
    """Every policy at three capacities, replayed in two worker processes: the same rows, in
    the same order, as one replay after another."""
    argv = ["simulate", "--synthetic", "mixed", "--requests", "200", "--sweep", "--json"]
    rows = []
    for jobs in ("1", "2"):
        assert main([*argv, "--capacities", "20,80,300", "--jobs", jobs]) == 0
        rows.append(json.loads(capsys.readouterr().out)["sweep"])
    assert len(rows[0]) == 3 * len({r["policy"] for r in rows[0]}) >= 12
    assert rows[0] == rows[1]


def test_sweep_capacities_are_sorted_once(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--synthetic", "chat", "--requests", "30", "--sweep", "--policy", "lru"]
    assert main([*argv, "--capacities", "10, 5,5", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["sweep"]
    assert [r["capacity_blocks"] for r in rows] == [5, 10]
