"""The life table's loops over states and age buckets (``kvtier.policy.lifetable``): the
exposure and events a refit starts from (``exposure_bm``), the smoothing of the hazards
(``smoothed_bm``), the windows and densities (``windows_bm``, ``densities_bm``), the running
minimum a policy ranks by (``running_min``), and the ring slot each tick retires
(``retire_slot``).

Each has a numpy form (the reference, which the pure build runs; the scans are prefix
compositions in log2(buckets) vectorised steps) and a C form (``_lifescans.c``: the same
operations on the same operands in the same order, as plain loops; results equal to the bit,
``tests/test_lifescans.py``). A refit of a table of ~80 states and 128 buckets spent about 1 ms
in numpy's calls, most of it their overhead, and a replay refits often (about a third of the
default policy's time on the shared trace); with the C forms it takes about 0.36 ms, 0.2 of it
in the loops. Every function here uses the C form when the compiled build is in use
(``kvtier._native.compiled``) and has it, numpy's otherwise.

Arrays are float64, bucket-major (``[bucket, state]``, C order) but where named otherwise: the
scans over buckets run down contiguous rows.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import numpy as np
import numpy.typing as npt

from kvtier import _native


def _kernel() -> ModuleType | None:
    """The C scans (``_lifescans``: its functions' docstrings give their arguments) when the
    compiled build is in use and has them (an install without a C compiler has neither), else
    None."""
    if not _native.compiled():
        return None
    try:
        return importlib.import_module("kvtier.policy._lifescans")
    except ImportError:
        return None


KERNEL = _kernel()
_NO_MEAN = np.zeros(0)  # the kernel's mean when there is no pull


def exposure_bm(
    xd: npt.NDArray[np.float64],
    ev: npt.NDArray[np.float64],
    opened: npt.NDArray[np.float64],
    done: npt.NDArray[np.int64],
    openw: npt.NDArray[np.float64],
    tail: npt.NDArray[np.float64],
    f: npt.NDArray[np.float64],
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """A life table's exposure and events by [bucket, state], weighted by ``f`` (per bucket),
    from its state-major rows: ``xd`` ``[n, k + 1]`` the exposure differences of closed and
    censored lives, ``opened`` the weight of every state's open lives (starting at bucket 0),
    ``openw`` ``[n, ring]`` the same by ring slot, each ended at its row ``done[slot]`` (the
    buckets it completed), ``tail`` the exposure past the last bucket, ``ev`` ``[n, k]`` the
    events. Returns new C-contiguous ``(expo, events)``, each ``[k, n]``."""
    n, k = ev.shape
    expo, events = np.empty((k, n)), np.empty((k, n))
    if KERNEL is not None:
        KERNEL.exposure(xd, ev, opened, done, openw, tail, f, expo, events)
        return expo, events
    diff = xd.T.copy()  # [k + 1, n]
    diff[0] += opened
    _subtract_at(diff, done, openw)
    np.cumsum(diff[:k], axis=0, out=expo)
    expo[k - 1] += tail
    fc = f[:, None]
    expo *= fc
    np.multiply(ev.T, fc, out=events)
    return expo, events


def retire_slot(
    open_: npt.NDArray[np.float64],
    old: npt.NDArray[np.float64],
    old_sb: npt.NDArray[np.float64],
    slot: int,
    start: float,
) -> None:
    """Move the open lives of ring ``slot`` (``open_[:, slot]``, start bucket ``start``) into
    the old pool: ``old += them``, ``old_sb += them x start``, the slot emptied (the sum and
    product of ``LifeTable.tick``'s general case, for one column)."""
    if KERNEL is None:
        col = open_[:, slot]
        old += col + 0.0
        old_sb += col * start + 0.0
        col[:] = 0.0
    else:
        KERNEL.retire(open_, old, old_sb, slot, start)


def smoothed_bm(
    events: npt.NDArray[np.float64],
    expo: npt.NDArray[np.float64],
    prior: float,
    pooled: float,
    mean_pull: float = 0.0,
    family: npt.NDArray[np.int64] | None = None,
    window: float = 0.0,
) -> npt.NDArray[np.float64]:
    """Hazards ``h[b, s] = (events + prior * ((1 - p) * h[b - 1, s] + p * r[b, s])) / (exposure
    + prior)`` (``p``: ``mean_pull``; ``r``: the local rates, ``_local_rates_bm``), bucket 0's
    ``h[b - 1]`` being the pooled hazard of bucket 0 (``pooled``), clipped to [0, 1]. Overwrites
    ``events`` and ``expo`` (C-contiguous); returns one of them.

    Pulled only towards the bucket before, a state's hazard falls geometrically through a run of
    buckets without events and stays near zero wherever data is thin after it: old blocks of a
    state whose reuse comes late looked worthless (densities of 1e-13 on the shared trace). The
    local rate holds such ages at the rate seen at the nearest younger ages with data. (Its
    first form, the state's mean over all ages, is dominated by the young ages where most uses
    and lives are: a state whose hazard falls with age came back to it at every thin old age,
    and near a trace's top the blocks that were never coming back outranked young ones.)"""
    mean = state_means(events, expo, prior, family) if mean_pull > 0.0 else _NO_MEAN
    if KERNEL is not None:
        KERNEL.smooth(events, expo, mean, prior, pooled, mean_pull, window)
        return events
    # numpy: the recurrence is affine in h[b - 1], so it is a prefix composition of affine maps,
    # computed in log2(buckets) steps
    k = events.shape[0]
    if mean_pull > 0.0:
        events += (prior * mean_pull) * _local_rates_bm(events, expo, mean, window)
    expo += prior
    c = np.divide(events, expo, out=events)  # h[b] = a[b] * h[b - 1] + c[b]
    a = np.divide(prior * (1.0 - mean_pull), expo, out=expo)
    na = np.empty_like(a)  # the next a (written beside a: no copy of it)
    d = 1
    while d < k:  # (a, c)[b] := (a, c)[b] after (a, c)[b - d]: maps over 2d buckets
        c[d:] += np.multiply(a[d:], c[:-d], out=na[d:])
        np.multiply(a[d:], a[:-d], out=na[d:])
        na[:d] = a[:d]
        a, na = na, a
        d *= 2
    np.multiply(a, pooled, out=a)
    a += c
    h: npt.NDArray[np.float64] = np.clip(a, 0.0, 1.0, out=a)
    return h


def windows_bm(
    h: npt.NDArray[np.float64], steps: int
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """For every start bucket: the chance of no use over the next ``steps`` buckets (a power of
    two) and the expected buckets held meanwhile (trapezoid rule), hazards past the last bucket
    being the last's. Returns new arrays ``[k, n]`` (views of ``[k + 1, n]`` ones)."""
    if KERNEL is None:
        return _windows_np(h, steps)
    k, n = h.shape
    surv, held = np.empty((k + 1, n)), np.empty((k + 1, n))
    KERNEL.windows(np.ascontiguousarray(h), steps, surv, held, False)
    return surv[:k], held[:k]


def densities_bm(h: npt.NDArray[np.float64], steps: int) -> npt.NDArray[np.float64]:
    """The hit density from each bucket (``[k, n]``, a view): the chance of a use within the
    next ``steps`` buckets over the expected buckets held until then (``windows_bm``)."""
    if KERNEL is None:
        surv, held = _windows_np(h, steps)
        np.subtract(1.0, surv, out=surv)
        np.maximum(held, 1e-12, out=held)
        dens: npt.NDArray[np.float64] = np.divide(surv, held, out=surv)
        return dens
    k, n = h.shape
    surv, held = np.empty((k + 1, n)), np.empty((k + 1, n))
    KERNEL.windows(np.ascontiguousarray(h), steps, surv, held, True)
    return surv[:k]


def running_min(dens: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """``out[s, b]``: the lowest of ``dens[0 .. b, s]`` (``dens`` bucket-major ``[k, n]``; a new
    C-contiguous state-major ``[n, k]``)."""
    if KERNEL is None:
        low: npt.NDArray[np.float64] = np.ascontiguousarray(np.minimum.accumulate(dens, axis=0).T)
        return low
    k, n = dens.shape
    out = np.empty((n, k))
    KERNEL.running_min(np.ascontiguousarray(dens), out)
    return out


def state_means(
    events: npt.NDArray[np.float64],
    expo: npt.NDArray[np.float64],
    prior: float,
    family: npt.NDArray[np.int64] | None,
) -> npt.NDArray[np.float64]:
    """Each state's events over its exposure at all ages, smoothed with ``prior`` of exposure
    towards its ``family``'s mean (None: unsmoothed; a state without exposure: 0)."""
    tot = expo.sum(axis=0)
    ev = events.sum(axis=0)
    if family is not None:
        fam_ev, fam_x = np.bincount(family, ev), np.bincount(family, tot)
        fam = np.divide(fam_ev, fam_x, out=np.zeros_like(fam_ev), where=fam_x > 0)
        mean: npt.NDArray[np.float64] = (ev + prior * fam[family]) / (tot + prior)
        return mean
    alone: npt.NDArray[np.float64] = np.divide(ev, tot, out=np.zeros_like(tot), where=tot > 0)
    return alone


# -- numpy --------------------------------------------------------------------------------------
def _subtract_at(
    xd: npt.NDArray[np.float64], rows: npt.NDArray[np.int64], w: npt.NDArray[np.float64]
) -> None:
    """``xd[rows[j]] -= w[:, j]`` for each ``j`` in order, as ``np.subtract.at``: a row named
    more than once takes its columns one by one, in order."""
    named = np.bincount(rows)[rows]
    if named.max(initial=0) <= 1:
        xd[rows] -= w.T
        return
    once = named == 1
    xd[rows[once]] -= w[:, once].T
    for j in np.flatnonzero(~once).tolist():
        xd[rows[j]] -= w[:, j]


def _local_rates_bm(
    events: npt.NDArray[np.float64],
    expo: npt.NDArray[np.float64],
    mean: npt.NDArray[np.float64],
    window: float,
) -> npt.NDArray[np.float64]:
    """The rate each (bucket, state) is pulled towards (``[k, n]``): the state's events over the
    last ``window`` of its exposure in younger buckets (the oldest bucket of it pro rata); where
    the younger buckets hold less than ``window``, what is missing counts at the state's
    ``mean`` (``state_means``). ``window`` 0: the mean at every bucket (``[1, n]``)."""
    k, n = events.shape
    if window <= 0.0:
        every: npt.NDArray[np.float64] = mean[None, :]
        return every
    xc = np.zeros((k + 1, n))  # exposure and events in buckets < b, b = 0 .. k
    np.cumsum(expo, axis=0, out=xc[1:])
    ec = np.zeros((k + 1, n))
    np.cumsum(events, axis=0, out=ec[1:])
    # events as a function of exposure (piecewise linear), read ``window`` before each bucket in
    # one lookup over the states' columns laid end to end (each offset past the last)
    back = xc[:k] - window
    offset = (xc[k].max() + 1.0) * np.arange(n)
    at = np.interp(
        (np.maximum(back, 0.0) + offset).T.ravel(), (xc + offset).T.ravel(), ec.T.ravel()
    )
    out: npt.NDArray[np.float64] = ec[:k] - at.reshape(n, k).T
    out += np.clip(np.negative(back, out=back), 0.0, None, out=back) * mean
    out /= window
    return out


def _windows_np(
    h: npt.NDArray[np.float64], steps: int
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """``windows_bm`` in numpy. Windows double log2(steps) times: (survival, held) over 2m
    buckets are survival(m) x survival(m, later) and held(m) + survival(m) x held(m, later).

    Every window that starts at the last bucket or later is the same (the same hazards, in the
    same order), so row ``k`` stands for all of them: a window whose later half starts there
    takes row ``k`` as that half."""
    k, n = h.shape
    surv = np.empty((k + 1, n))
    np.subtract(1.0, h, out=surv[:k])
    surv[k] = surv[k - 1]
    held = np.add(1.0, surv)
    held *= 0.5
    ns, nh = np.empty_like(surv), np.empty_like(surv)  # the next windows
    m = 1
    while m < steps:
        j = max(k + 1 - m, 0)  # windows j.. take row k as their later half
        np.multiply(surv[:j], held[m:], out=nh[:j])
        np.multiply(surv[j:], held[k], out=nh[j:])
        nh += held
        np.multiply(surv[:j], surv[m:], out=ns[:j])
        np.multiply(surv[j:], surv[k], out=ns[j:])
        surv, ns, held, nh = ns, surv, nh, held
        m *= 2
    return surv[:k], held[:k]


# -- state-major forms, for tests and tools ------------------------------------------------------
def smoothed(
    events: npt.NDArray[np.float64],
    expo: npt.NDArray[np.float64],
    prior: float,
    mean_pull: float = 0.0,
    family: npt.NDArray[np.int64] | None = None,
    window: float = 0.0,
) -> npt.NDArray[np.float64]:
    """``smoothed_bm`` for state-major arrays (``[state, bucket]``), bucket 0 pulled towards the
    pooled hazard of every state's bucket 0; the inputs are kept."""
    tot_x = expo[:, 0].sum()
    pooled = events[:, 0].sum() / tot_x if tot_x > 0 else 0.0
    h = smoothed_bm(events.T.copy(), expo.T.copy(), prior, pooled, mean_pull, family, window)
    return h.T


def windows(
    h: npt.NDArray[np.float64], steps: int
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """``windows_bm`` for state-major arrays (``[state, bucket]``)."""
    surv, held = windows_bm(np.ascontiguousarray(h.T), steps)
    return surv.T, held.T
