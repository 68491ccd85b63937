"""The optional compiled build of the simulator's hot modules, and the guard that keeps it honest.

``pip install -e .`` (``setup.py``) compiles the modules it lists with mypyc when it can, and
records in ``_native.json`` beside this file each one's source hash (and the globs that chose
them). Python imports an extension module in preference to the ``.py`` beside it, so in an
editable checkout an edited source would silently not take effect. ``install`` (run by
``kvtier/__init__.py`` before anything imports those modules) puts a finder first on
``sys.meta_path``; the first time one of the modules is imported it checks the build against the
sources (``Build.stale``), and if any source changed, a compiled module is missing or a new source
matches the globs, it loads *all* the modules of the build from their ``.py`` sources -- they
call each other directly in C, so compiled and pure ones cannot be mixed -- and warns once.
``KVTIER_PURE=1`` in the environment loads the pure modules the same way, without a warning.
``compiled()`` says whether the compiled modules are in use.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib.abc import MetaPathFinder
from importlib.machinery import EXTENSION_SUFFIXES, ModuleSpec
from importlib.util import spec_from_file_location
from pathlib import Path
from types import ModuleType

PACKAGE = Path(__file__).resolve().parent
MANIFEST = PACKAGE / "_native.json"


def pure_requested() -> bool:
    """``KVTIER_PURE`` is set (to anything but ``0``): use the pure-Python modules."""
    return os.environ.get("KVTIER_PURE", "") not in ("", "0")


def source(module: str) -> Path:
    """The ``.py`` source of ``module`` (``kvtier.policy.lru`` -> ``.../kvtier/policy/lru.py``)."""
    return PACKAGE.joinpath(*module.split(".")[1:]).with_suffix(".py")


@dataclass(frozen=True)
class Build:
    """What a compiled build recorded (``setup.py``): module -> sha256 of its source, the
    same for its C ``kernels`` (source: the module's path with ``.c``), and the globs (relative
    to the package's parent) that chose the modules, less ``excluded``."""

    modules: dict[str, str] = field(default_factory=dict)
    globs: list[str] = field(default_factory=list)
    excluded: list[str] = field(default_factory=list)
    kernels: dict[str, str] = field(default_factory=dict)

    @classmethod
    def read(cls, manifest: Path = MANIFEST) -> Build:
        """The build recorded in ``manifest`` (empty: no compiled build)."""
        try:
            data = json.loads(manifest.read_text())
            return cls(
                dict(data["modules"]),
                list(data["globs"]),
                list(data["excluded"]),
                dict(data.get("kernels", {})),
            )
        except (OSError, ValueError, KeyError, TypeError):
            return cls()

    def stale(self) -> list[str]:
        """The modules out of date: source changed or extension module missing, and the
        sources the globs match now that the build did not compile."""
        out = []
        built = [(m, d, source(m)) for m, d in self.modules.items()]
        built += [(m, d, source(m).with_suffix(".c")) for m, d in self.kernels.items()]
        for module, digest, src in built:
            try:
                current = hashlib.sha256(src.read_bytes()).hexdigest() == digest
            except OSError:
                current = False
            if not current or not any(src.with_suffix(s).exists() for s in EXTENSION_SUFFIXES):
                out.append(module)
        for pattern in self.globs:
            for path in PACKAGE.parent.glob(pattern):
                rel = path.relative_to(PACKAGE.parent).as_posix()
                module = rel.removesuffix(".py").replace("/", ".")
                if rel not in self.excluded and module not in self.modules:
                    out.append(module)
        return sorted(out)


class Guard(MetaPathFinder):
    """Loads the modules of a build from their sources when it is stale or ``KVTIER_PURE`` is
    set; otherwise finds nothing (the usual finders load the extension modules)."""

    def __init__(self, build: Build) -> None:
        self.build = build
        self._pure: bool | None = None  # decided on the first import of one of the modules

    def pure(self) -> bool:
        """Whether the build's modules load from their sources (decided once, warned once)."""
        if self._pure is None:
            changed = self.build.stale()
            self._pure = pure_requested() or bool(changed)
            if changed and not pure_requested():
                warnings.warn(
                    f"kvtier: the compiled build is out of date ({', '.join(changed)}): using "
                    "the pure-Python modules, which are slower. Rerun scripts/setup.sh to "
                    "rebuild it.",
                    RuntimeWarning,
                    stacklevel=3,  # the import that asked for the module
                )
        return self._pure

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname not in self.build.modules or not self.pure():
            return None
        return spec_from_file_location(fullname, source(fullname))


_guard: Guard | None = None


def install(manifest: Path = MANIFEST) -> None:
    """Put the guard for the build recorded in ``manifest`` first on ``sys.meta_path``
    (replacing one installed before; modules already imported stay as they are)."""
    global _guard
    if _guard is not None and _guard in sys.meta_path:
        sys.meta_path.remove(_guard)
    _guard = Guard(Build.read(manifest))
    if _guard.build.modules:
        sys.meta_path.insert(0, _guard)


def compiled() -> bool:
    """Whether the compiled modules are in use (built, current, and ``KVTIER_PURE`` unset)."""
    return _guard is not None and bool(_guard.build.modules) and not _guard.pure()
