"""The optional compiled build (setup.py) and its guard (kvtier/_native.py): the build is in use
after setup, a stale build or KVTIER_PURE=1 loads every module of the build from its source.

The guard's checks run in a subprocess: a process imports each module once, compiled or not."""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import subprocess
import sys
from importlib.machinery import EXTENSION_SUFFIXES, PathFinder
from pathlib import Path
from types import FunctionType
from typing import Any

import pytest

from kvtier import _native
from kvtier.policy.s3fifo import S3FIFO

#: modules every build compiles (setup.py's COMPILED), checked when there is no build to read
SOME = ["kvtier.policy.base", "kvtier.policy.lru", "kvtier.policy.s3fifo", "kvtier.sim.replay"]

PROBE = """
import json, sys, warnings
from pathlib import Path
import kvtier._native as native
if len(sys.argv) > 2:
    native.install(Path(sys.argv[2]))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import kvtier.policy, kvtier.sim.replay, kvtier.sim.belady
    from kvtier.sim.replay import TierSpec, replay
    from tests.test_sim import tree_trace
    trace = tree_trace(7, n_req=600, nodes=300)
    setups = [
        [TierSpec("a", 30, "s3fifo"), TierSpec("b", 60, "density")],
        [TierSpec("a", 30, "density"), TierSpec("b", 60, "density"), TierSpec("c", 90, "density")],
        [TierSpec("a", 40, "density-always")],
        [TierSpec("a", 40, "density")],
    ]
    runs = [replay(trace, tiers) for tiers in setups]
    ratio = runs[0]
    for m in json.loads(sys.argv[1]):
        __import__(m)
print(json.dumps({
    "files": {m: sys.modules[m].__file__ for m in json.loads(sys.argv[1])},
    "warnings": [str(w.message) for w in caught],
    "compiled": native.compiled(),
    "ratio": ratio.token_hit_ratio,
    "replays": [
        [r.hit_tokens.tolist(), list(r.written_blocks), list(r.evicted_blocks)] for r in runs
    ],
}))
"""


def probe(modules: list[str], manifest: Path | None = None, pure: bool = False) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "KVTIER_PURE"}
    if pure:
        env["KVTIER_PURE"] = "1"
    args = [json.dumps(modules), *([str(manifest)] if manifest else [])]
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *args],
        env=env,
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def built_modules() -> list[str]:
    return sorted(_native.Build.read().modules) or SOME


def test_the_compiled_build_is_in_use_after_setup() -> None:
    build = _native.Build.read()
    if not build.modules:
        pytest.skip("no compiled build (no C compiler, or installed with KVTIER_PURE=1)")
    if _native.pure_requested():
        pytest.skip("KVTIER_PURE is set")
    assert set(SOME) <= set(build.modules)
    assert "kvtier.policy" not in build.modules  # the registry stays a plain package
    assert not build.stale(), "the compiled build is out of date: rerun scripts/setup.sh"
    assert _native.compiled()
    for name in build.modules:  # each one's extension module, found beside its source
        module = importlib.import_module(name)  # (its __file__ may be off: mypyc derives it)
        assert any(str(module.__file__).endswith(s) for s in EXTENSION_SUFFIXES), module
        package = importlib.import_module(name.rpartition(".")[0])
        spec = PathFinder.find_spec(name, package.__path__)
        assert spec is not None and spec.origin is not None
        assert Path(spec.origin).parent == _native.source(name).parent
        assert any(spec.origin.endswith(s) for s in EXTENSION_SUFFIXES), spec.origin
    assert not isinstance(S3FIFO.insert, FunctionType)  # native code, not Python bytecode


def test_a_stale_build_loads_every_module_from_source_and_warns_once(tmp_path: Path) -> None:
    """A manifest whose hash of one source no longer matches (as after an edit): all of the
    build's modules come from their sources, and one warning says to rebuild."""
    modules = built_modules()
    hashes = {m: hashlib.sha256(_native.source(m).read_bytes()).hexdigest() for m in modules}
    hashes["kvtier.policy.s3fifo"] = "0" * 64
    manifest = tmp_path / "_native.json"
    manifest.write_text(json.dumps({"modules": hashes, "globs": [], "excluded": []}))
    out = probe(modules, manifest)
    files = out["files"]
    assert isinstance(files, dict)
    assert all(f.endswith(".py") for f in files.values()), files
    assert not out["compiled"]
    warnings = out["warnings"]
    assert isinstance(warnings, list) and len(warnings) == 1, warnings
    assert "kvtier.policy.s3fifo" in warnings[0] and "scripts/setup.sh" in warnings[0]


def test_kvtier_pure_loads_every_module_from_source() -> None:
    modules = built_modules()
    out = probe(modules, pure=True)
    files = out["files"]
    assert isinstance(files, dict)
    assert all(f.endswith(".py") for f in files.values()), files
    assert not out["compiled"] and out["warnings"] == []


def test_compiled_and_pure_replays_agree() -> None:
    """The same replays (S3-FIFO over density; three density tiers; one), as this process's
    build runs them and pure: every request's hits per tier and every tier's writes and
    evictions are the same (bit-identical)."""
    modules = built_modules()
    built, pure = probe(modules), probe(modules, pure=True)
    assert built["ratio"] == pure["ratio"] and built["ratio"] > 0
    assert built["replays"] == pure["replays"]


def test_stale_lists_changed_sources_and_new_ones_the_globs_match() -> None:
    build = _native.Build(
        modules={"kvtier.policy.lru": "0" * 64},
        globs=["kvtier/policy/l*.py"],
        excluded=["kvtier/policy/lifestates.py"],
    )
    stale = build.stale()
    assert "kvtier.policy.lru" in stale  # changed
    assert "kvtier.policy.lifetable" in stale  # matched now, not compiled by that build
    assert "kvtier.policy.lifestates" not in stale  # excluded
    assert _native.Build.read(Path("/nonexistent/_native.json")) == _native.Build()


def test_a_changed_kernel_source_makes_the_build_stale() -> None:
    """The C kernels' sources are in the manifest too: an edit to one is caught as for a module."""
    build = _native.Build(kernels={"kvtier.policy._lifescans": "0" * 64})
    assert build.stale() == ["kvtier.policy._lifescans"]
    built = _native.Build.read()
    if built.modules and not _native.pure_requested():
        from kvtier.policy import lifescans

        assert "kvtier.policy._lifescans" in built.kernels
        assert lifescans.KERNEL is not None  # the compiled build uses its kernel
