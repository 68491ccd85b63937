"""What this machine's memory can hold: checked before a tier allocates, so an impossible size
is a ``ConfigError`` that names the key and says what fits, not a ``MemoryError`` (or an
``OverflowError``) from deep inside an allocation, or a machine driven into swap.

"Available" is the kernel's ``MemAvailable`` (what can be allocated without swapping, page cache
it can drop included), capped by the cgroup's limit where there is one (a container), read at
the moment of the check: a tier that fits now may still compete with what starts later.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvtier.errors import ConfigError

_CGROUP = Path("/sys/fs/cgroup")


def memory_bytes() -> tuple[int, int]:
    """(available, total) bytes of memory this process may allocate now."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError, IndexError):
        pass  # not Linux, or an odd /proc: the sysconf figures stand
    try:
        limit = (_CGROUP / "memory.max").read_text().strip()
        if limit != "max":
            used = int((_CGROUP / "memory.current").read_text())
            total = min(total, int(limit))
            avail = min(avail, max(0, int(limit) - used))
    except (OSError, ValueError):
        pass  # no cgroup v2 limit
    return avail, total


def require_memory(what: str, capacity: int, need: int) -> None:
    """Raise ``ConfigError`` unless ``need`` bytes of memory, what ``capacity`` bytes of
    ``what`` (a tier's capacity key) will take, are available now; the message says how much
    capacity would fit (in proportion)."""
    avail, total = memory_bytes()
    if need <= avail:
        return
    fits = capacity * avail // need if need else 0
    raise ConfigError(
        f"{what} {_human(capacity)} needs {_human(need)} of memory, but this machine has "
        f"{_human(avail)} available ({_human(total)} in all); lower {what} to at most "
        f"{_human(fits)}"
    )


def _human(n: int) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.4g} {unit}" if n < 1 << 60 else f"{n:.3g} bytes"
    return f"{n} bytes"
