"""Smoke tests of ``kvtier bench host``, ``seal`` and ``disk`` at tiny sizes.

Timing is not asserted: each bench must name its baselines and their settings, report a ratio
against the best of them, and move the bytes back unchanged.
"""

from __future__ import annotations

import argparse
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest

from kvtier.bench import disk, host, seal

SMALL = "Qwen2.5-7B"  # the smallest preset block (14 MiB at fp16, 256 tokens)


def _run(module: Any, *argv: str) -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    result: dict[str, Any] = module.run(parser.parse_args(list(argv)))
    return result


def test_bench_host_reports_every_copy_and_the_ratio_to_the_best() -> None:
    out = _run(host, "--model", SMALL, "--gib", "0.03", "--rounds", "2", "--workers", "1")
    assert out["identical"] is True and out["tier_threads"] == 2
    copies = {f"memcpy_{kind}_{t}t" for kind in ("blocks", "blocks_out", "whole") for t in (1, 2)}
    assert {f"{c}_gbps" for c in copies} <= set(out)
    assert out["store_baseline"] in copies and out["load_baseline"] in copies
    for side in ("store", "load"):
        best = out[f"{out[f'{side}_baseline']}_gbps"]
        assert out[f"{side}_vs_best"] == pytest.approx(out[f"{side}_gbps"] / best)
        assert len(out[f"{side}_vs_best_rounds"]) == 2
        fused = out[f"{side}_copy_hash_baseline"]  # the checksummed copies: reported, not a limit
        assert fused.startswith("copy_hash_blocks") and fused != out[f"{side}_baseline"]
        assert out[f"{side}_vs_copy_hash"] == pytest.approx(
            out[f"{side}_gbps"] / out[f"{fused}_gbps"]
        )
    assert out["lookup_miss_us"] > 0


def test_bench_seal_times_every_mode_against_memcpy() -> None:
    out = _run(seal, "--model", SMALL, "--block-tokens", "16", "--blocks", "2", "--rounds", "1")
    for mode in seal.MODES:
        for step in (f"seal_{mode}", f"open_{mode}", f"open_{mode}_strided"):
            assert out[f"{step}_gbps"] > 0 and out[f"{step}_vs_memcpy"] > 0
    assert out["open_mac_vs_memcpy"] == pytest.approx(
        out["open_mac_gbps"] / out["memcpy_contiguous_gbps"]
    )


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio not installed (scripts/test.sh)")
def test_bench_disk_searches_fio_settings_and_reports_latency(tmp_path: Path) -> None:
    out = _run(disk, "--model", SMALL, "--size", "28MiB", "--batch", "2", "--workers", "2",
               "--repeat", "1", "--reopen-blocks", "50", "--dir", str(tmp_path / "b"))  # fmt: skip
    assert out["raw_limit"].startswith("fio")
    tried = {"numjobs=1 iodepth=1", "numjobs=1 iodepth=2", "numjobs=2 iodepth=1"}
    assert set(out["fio_write"]) == tried == set(out["fio_read"])  # at most 2 in flight
    assert out["raw_write_best"] in tried and out["raw_read_best"] in tried
    assert out["store_vs_raw"] == pytest.approx(out["store_gbps"] / out["raw_write_gbps"])
    assert out["load_vs_raw"] == pytest.approx(out["load_gbps"] / out["raw_read_gbps"])
    for step in ("store", "load"):
        lat = out[f"{step}_latency_ms"]
        assert 0 < lat["p50"] <= lat["p99"]
    assert out["reopen_s"] > 0 and not (tmp_path / "b").exists()


def test_bench_disk_says_when_fio_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # a PATH without fio
    caplog.set_level(logging.WARNING, logger="kvtier.bench.disk")
    out = _run(disk, "--model", SMALL, "--size", "28MiB", "--batch", "2", "--workers", "2",
               "--repeat", "1", "--reopen-blocks", "0", "--dir", str(tmp_path / "b"))  # fmt: skip
    assert out["raw_limit"] == disk.FIO_MISSING and disk.FIO_MISSING in caplog.text
    assert out["raw_write_gbps"] is None and out["store_vs_raw"] is None
    assert out["load_vs_raw"] is None and out["store_gbps"] > 0 and out["load_gbps"] > 0
