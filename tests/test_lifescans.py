"""The life table's scans (kvtier/policy/lifescans.py): the C kernel (_lifescans.c) gives
numpy's results to the bit, on random tables (zero and rounding-negative exposure, families or
none, every window), and rejects arrays it cannot read with a clear error."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from kvtier.policy import lifescans


@pytest.fixture
def kernel() -> Iterator[ModuleType]:
    """The C kernel, also when this process runs the pure modules (it is a plain extension)."""
    try:
        from kvtier.policy import _lifescans
    except ImportError:
        pytest.skip("the C kernel is not built (no C compiler, or KVTIER_PURE at install)")
    yield _lifescans


def _use(kernel: ModuleType | None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lifescans, "KERNEL", kernel)


def _table(rng: np.random.Generator, k: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Events and exposure ``[k, n]`` of a few scales, with buckets no life reached and (the
    exposure sums' rounding) a few a hair below zero."""
    events = rng.random((k, n)) * rng.choice([0.01, 3.0, 500.0], (1, n))
    expo = events + rng.random((k, n)) * 10
    if k > 3:
        expo[k // 3 : k // 2, ::3] = events[k // 3 : k // 2, ::3] = 0.0
        expo[-3:, 1::2] = -1e-12 * rng.random(expo[-3:, 1::2].shape)
        events[-3:, 1::2] = 0.0
    return events, expo


def _both(
    kernel: ModuleType, monkeypatch: pytest.MonkeyPatch, f: Callable[..., Any], *args: Any
) -> list[Any]:
    """``f(*args)`` with numpy's scans and with the kernel (fresh copies of array arguments)."""
    out = []
    for use in (None, kernel):
        _use(use, monkeypatch)
        out.append(f(*[a.copy() if isinstance(a, np.ndarray) else a for a in args]))
    return out


@pytest.mark.parametrize("seed", range(40))
def test_smoothing_and_densities_are_numpys_to_the_bit(
    seed: int, kernel: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(seed)
    k, n = int(rng.integers(1, 140)), int(rng.integers(1, 90))
    events, expo = _table(rng, k, n)
    prior = float(rng.choice([1.0, 30.0, 400.0]))
    pull = float(rng.choice([0.0, 0.7, 1.0]))
    window = float(rng.choice([0.0, 15.0, 2000.0, 1e12]))
    family = rng.integers(0, max(1, n // 3), n) if seed % 4 else None
    pooled = float(rng.random() * 0.1)
    h_np, h_c = _both(
        kernel,
        monkeypatch,
        lifescans.smoothed_bm,
        events,
        expo,
        prior,
        pooled,
        pull,
        family,
        window,
    )
    assert np.array_equal(h_np, h_c) and np.array_equal(np.signbit(h_np), np.signbit(h_c))
    steps = 1 << int(rng.integers(0, 9))
    (s_np, held_np), (s_c, held_c) = _both(kernel, monkeypatch, lifescans.windows_bm, h_np, steps)
    assert np.array_equal(s_np, s_c) and np.array_equal(held_np, held_c)
    d_np, d_c = _both(kernel, monkeypatch, lifescans.densities_bm, h_np, steps)
    assert np.array_equal(d_np, d_c)
    low_np, low_c = _both(kernel, monkeypatch, lifescans.running_min, d_np)
    assert np.array_equal(low_np, low_c) and low_c.flags.c_contiguous
    assert np.all(np.diff(low_c, axis=1) <= 0)


@pytest.mark.parametrize("seed", range(12))
def test_exposure_is_numpys_to_the_bit(
    seed: int, kernel: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ring slots ending in the same bucket (taken one by one, in order, as np.subtract.at) or
    each in its own (seed 0), open lives ending at bucket 0 and at the last row."""
    rng = np.random.default_rng(seed)
    k, n, ring = int(rng.integers(2, 130)), int(rng.integers(1, 80)), int(rng.integers(1, 140))
    xd = rng.normal(size=(n, k + 1)) * 50
    ev = rng.random((n, k)) * 5
    openw = rng.random((n, ring)) * 3
    done = rng.permutation(k + 1)[:ring] if seed == 0 else rng.integers(0, k + 1, ring)
    opened, tail, f = rng.random(n) * 9, rng.random(n), np.exp(rng.random(k))
    (x_np, e_np), (x_c, e_c) = _both(
        kernel, monkeypatch, lifescans.exposure_bm, xd, ev, opened, done, openw, tail, f
    )
    assert np.array_equal(x_np, x_c) and np.array_equal(e_np, e_c)
    assert x_c.shape == (k, n) and x_c.flags.c_contiguous


def test_the_kernel_rejects_arrays_it_cannot_read(kernel: ModuleType) -> None:
    h = np.full((8, 3), 0.1)
    surv, held = np.empty((9, 3)), np.empty((9, 3))
    with pytest.raises(ValueError, match="float64"):
        kernel.windows(h.astype(np.float32), 4, surv, held, True)
    with pytest.raises(ValueError, match=r"\[k \+ 1, n\]"):
        kernel.windows(h, 4, np.empty((8, 3)), held, True)
    with pytest.raises((ValueError, BufferError), match="contiguous"):
        kernel.smooth(np.ones((3, 8)).T, np.ones((8, 3)), np.ones(3), 1.0, 0.1, 0.5, 0.0)
    with pytest.raises(ValueError, match=r"mean \[n\]"):
        kernel.smooth(np.ones((8, 3)), np.ones((8, 3)), np.ones(2), 1.0, 0.1, 0.5, 0.0)
    frozen = np.ones((8, 3))
    frozen.flags.writeable = False
    with pytest.raises((ValueError, BufferError)):
        kernel.smooth(frozen, np.ones((8, 3)), np.ones(3), 1.0, 0.1, 0.5, 0.0)
    args = [np.zeros((3, 9)), np.zeros((3, 8)), np.zeros(3), np.array([0, 9]), np.zeros((3, 2))]
    out = [np.zeros(3), np.ones(8), np.empty((8, 3)), np.empty((8, 3))]
    with pytest.raises(ValueError, match="done rows"):
        kernel.exposure(*args, *out)
    args[3] = np.array([0.0, 1.0])
    with pytest.raises(ValueError, match="int64"):
        kernel.exposure(*args, *out)


def test_retiring_a_ring_slot_is_numpys_to_the_bit(
    kernel: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(5)
    open_, old, old_sb = rng.random((40, 17)), rng.random(40), rng.normal(size=40) * 1e3
    got = []
    for use in (None, kernel):
        _use(use, monkeypatch)
        arrays = [open_.copy(), old.copy(), old_sb.copy()]
        lifescans.retire_slot(*arrays, 5, -12.0)
        got.append(arrays)
    for a, b in zip(*got, strict=True):
        assert np.array_equal(a, b)
    assert not got[1][0][:, 5].any() and np.array_equal(got[1][0][:, 4], open_[:, 4])
