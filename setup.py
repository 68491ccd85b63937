"""Build kvtier, compiling the simulator's hot modules with mypyc when it can.

``COMPILED`` below is the one place that says which modules are compiled: every module of
``kvtier/policy/`` (the eviction policies, where a replay spends its time) but the package's
``__init__`` (the registry: no hot code, and a plain package keeps it importable as usual), plus
the replay loop and the tier chain that drive them. They are compiled as one mypyc group
(``kvtier/_native__mypyc*.so`` holds the code, each module a small shim), so the modules call
each other directly in C. ``KERNELS`` are hand-written C extension modules built with the group
(the life table's scans), which the compiled modules use when the build is current.

The compiled build is optional: with ``KVTIER_PURE=1`` set at install, or when mypyc or the C
compiler fails, the install goes on pure Python (the reason is printed: ``pip -v``). A build
records each compiled module's and kernel's source hash in ``kvtier/_native.json``; ``kvtier/_native.py``
reads it at import and falls back to the pure modules when a source changed since (the guard
against an edit in an editable checkout silently not taking effect).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import sys
import traceback
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path
from typing import Any

from setuptools import Distribution, Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
#: the modules compiled with mypyc: globs relative to the repository root (the only list)
COMPILED = ["kvtier/policy/*.py", "kvtier/sim/replay.py", "kvtier/sim/tierchain.py"]
EXCLUDED = {"kvtier/policy/__init__.py"}
GROUP = "kvtier._native"  # the shared library: kvtier/_native__mypyc.<abi>.so
MANIFEST = "kvtier/_native.json"  # module -> sha256 of the source it was compiled from
#: C kernels built with the group (and only with it): module -> source. -ffp-contract=off: no
#: fused multiply-adds, so the kernels' floats are numpy's to the bit (kvtier/policy/lifescans.py)
KERNELS = {"kvtier.policy._lifescans": "kvtier/policy/_lifescans.c"}
KERNEL_FLAGS = ["-O3", "-ffp-contract=off"]


def compiled_sources() -> list[str]:
    paths = {p for pattern in COMPILED for p in glob.glob(pattern, root_dir=ROOT)}
    return sorted(paths - EXCLUDED)


def pure_requested() -> bool:
    return os.environ.get("KVTIER_PURE", "") not in ("", "0")


def fall_back(what: str, e: BaseException) -> None:
    traceback.print_exception(e, file=sys.stderr)
    print(f"kvtier: {what} ({e!r}); installing pure Python", file=sys.stderr)
    _extensions[:] = [[]]


_extensions: list[list[Any]] = []  # mypyc's output, once per process


def extensions() -> list[Any]:
    """mypyc's extension modules for ``COMPILED`` ([] when pure), made on first use only:
    pip loads setup.py three times per install, and only the build needs them."""
    if not _extensions:
        if pure_requested():
            _extensions.append([])
            return []
        try:
            from mypyc.build import mypycify

            group = mypycify(compiled_sources(), opt_level="3", group_name=GROUP)
            kernels = [
                Extension(name, [src], extra_compile_args=KERNEL_FLAGS)
                for name, src in KERNELS.items()
            ]
            _extensions.append([*group, *kernels])
        except BaseException as e:  # mypyc reports type errors with sys.exit
            if isinstance(e, KeyboardInterrupt):
                raise
            fall_back("mypyc could not compile", e)
    return _extensions[0]


class BinaryDistribution(Distribution):
    """Always runs ``build_ext``: it decides there what to compile, and cleans up."""

    def has_ext_modules(self) -> bool:
        return True


class MypycBuildExt(build_ext):
    """``build_ext`` that compiles ``COMPILED`` with mypyc, or falls back to pure Python."""

    def finalize_options(self) -> None:
        self.distribution.ext_modules = extensions()
        super().finalize_options()

    def run(self) -> None:
        inplace = self.inplace or self.editable_mode
        if inplace:
            clean(ROOT)  # a previous build's .so files would shadow the sources
        if not self.extensions:
            if pure_requested():
                print("kvtier: KVTIER_PURE is set: installing pure Python", file=sys.stderr)
            clean(Path(self.build_lib))  # a previous build's, which the wheel would take
            return
        current = {p[:-3].replace("/", ".") for p in compiled_sources()} | {f"{GROUP}__mypyc"}
        current |= set(KERNELS)
        clean(Path(self.build_lib), keep=current)  # modules no longer compiled (renamed ...)
        try:
            super().run()
        except Exception as e:  # no C compiler, missing headers ...
            fall_back("compiling mypyc's output failed", e)
            self.extensions = []
            for base in (Path(self.build_lib), ROOT) if inplace else (Path(self.build_lib),):
                clean(base)
            return
        modules = {
            p[:-3].replace("/", "."): hashlib.sha256((ROOT / p).read_bytes()).hexdigest()
            for p in compiled_sources()
        }
        kernels = {
            name: hashlib.sha256((ROOT / src).read_bytes()).hexdigest()
            for name, src in KERNELS.items()
        }
        build = {
            "modules": modules,
            "kernels": kernels,
            "globs": COMPILED,
            "excluded": sorted(EXCLUDED),
        }
        text = json.dumps(build, indent=1, sort_keys=True)
        for base in (self.build_lib, ROOT) if inplace else (self.build_lib,):
            Path(base, MANIFEST).write_text(text + "\n")

    def get_outputs(self) -> list[str]:
        outs: list[str] = super().get_outputs()
        return [*outs, os.path.join(self.build_lib, MANIFEST)] if self.extensions else outs


def clean(base: Path, keep: set[str] | None = None) -> None:
    """Remove what an earlier build left under ``base`` (the source tree, in place, or the
    build folder): its manifest, and the extension modules of every module it lists or
    ``COMPILED`` lists now, and the group's -- but those named in ``keep`` (up to date ones)."""
    names = {p[:-3].replace("/", ".") for p in compiled_sources()} | {f"{GROUP}__mypyc"}
    names |= set(KERNELS)
    manifest = base / MANIFEST
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        built = json.loads(manifest.read_text())
        names |= set(built["modules"]) | set(built.get("kernels", {}))
    manifest.unlink(missing_ok=True)
    for name in names - (keep or set()):
        for suffix in EXTENSION_SUFFIXES:
            (base / (name.replace(".", "/") + suffix)).unlink(missing_ok=True)


setup(
    distclass=BinaryDistribution,
    cmdclass={"build_ext": MypycBuildExt},
)
