"""The online life table (``kvtier.policy.lifetable``): hazards learned from lives, recency
weighting, smoothing, the decay past the clock, and its numpy kernels against their loops."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvtier.policy.lifescans import _subtract_at
from kvtier.policy.lifescans import smoothed as _smoothed
from kvtier.policy.lifescans import windows as _windows
from kvtier.policy.lifetable import LifeTable


def _simulate_lives(table: LifeTable, hazard: float, lives: int, seed: int, t0: int = 0) -> int:
    """Lives of state 0 with a constant per-bucket hazard, started one per clock unit from
    ``t0``; each ends with a use at a geometric gap (or stays open). Returns the clock after."""
    rng = random.Random(seed)
    w = table.width
    ends: list[tuple[int, int]] = []
    for i in range(lives):
        start = t0 + i
        gap = 0
        while rng.random() >= hazard:
            gap += 1
        ends.append((start, start + gap * w + rng.randrange(w)))
        table.open(0, start, 1)
    now = t0 + lives
    for start, end in sorted(ends, key=lambda e: e[1]):
        if end >= now + 50 * w:
            continue  # still open when we look
        table.tick(end)
        now = max(now, end)
        table.close(0, start, end, 1)
    table.tick(now)
    return now


def test_life_table_recovers_a_constant_hazard() -> None:
    table = LifeTable(width=10, buckets=16, tau=1e9, horizon=40, prior=1.0)
    table.grow(1)
    now = _simulate_lives(table, 0.2, 4000, seed=1)
    table.refit(now)
    assert np.allclose(table.hazard[0, :6], 0.2, atol=0.03), table.hazard[0, :8]


def test_hazards_at_ages_older_than_the_clock_decay() -> None:
    """No life can be older than the clock: past it the hazard falls by ``unseen_decay`` a
    bucket (1 carries the last one seen on), so old blocks are not kept on a guess."""
    hazards = []
    for decay in (1.0, 0.5):
        table = LifeTable(width=10, buckets=64, tau=1e9, horizon=200, prior=1.0, unseen_decay=decay)
        table.grow(1)
        now = _simulate_lives(table, 0.2, 200, seed=4)  # ages up to ~ 200 + 50 buckets' worth
        table.refit(now)
        hazards.append(table.hazard[0])
        seen = now // 10 + 1
        assert seen < 64
        h = table.hazard[0]
        assert np.allclose(h[seen:], h[seen - 1] * decay ** np.arange(1, 64 - seen + 1))
    assert np.array_equal(hazards[0][:seen], hazards[1][:seen])  # what was seen is unchanged


def test_life_table_follows_the_recent_regime() -> None:
    """Weighting by recency: after a change of hazard, the table reads the new one."""
    table = LifeTable(width=10, buckets=16, tau=2000, horizon=40, prior=1.0)
    table.grow(1)
    now = _simulate_lives(table, 0.05, 3000, seed=2)
    now = _simulate_lives(table, 0.4, 3000, seed=3, t0=now + 20000)
    table.refit(now)
    assert table.hazard[0, 0] > 0.3, table.hazard[0, :4]


def test_closed_and_censored_lives_leave_no_open_weight() -> None:
    table = LifeTable(width=4, buckets=8, tau=50, horizon=16, prior=1.0)
    table.grow(2)
    for start in range(0, 400, 3):  # long past the ring (old lives) and the rebase
        table.tick(start)
        table.open(start % 2, start, 2)
    for start in range(0, 400, 3):
        table.close(start % 2, start, 400, 1)
        table.censor(start % 2, start, 400, 1)
    scale = np.exp((table._base - 400) / table.tau)
    assert np.abs(table._open[:2]).max() * scale < 1e-9
    assert np.abs(table._old[:2]).max() * scale < 1e-9


def _local_rates_loop(
    events: np.ndarray, expo: np.ndarray, prior: float, family: np.ndarray | None, window: float
) -> np.ndarray:
    """``_local_rates_bm`` as a loop (state-major): walk back from each bucket, taking exposure
    (and its events pro rata) until the window is full; short of it, the rest at the mean."""
    n, k = events.shape
    mean = events.sum(axis=1) / expo.sum(axis=1)
    if family is not None:
        for s in range(n):
            kin = family == family[s]
            fam = events[kin].sum() / expo[kin].sum()
            mean[s] = (events[s].sum() + prior * fam) / (expo[s].sum() + prior)
    if window <= 0:
        return np.repeat(mean[:, None], k, axis=1)
    out = np.empty((n, k))
    for s in range(n):
        for b in range(k):
            ev = x = 0.0
            for j in range(b - 1, -1, -1):
                take = min(expo[s, j], window - x)
                if take > 0:
                    ev += events[s, j] * take / expo[s, j]
                    x += take
            out[s, b] = (ev + (window - x) * mean[s]) / window
    return out


@pytest.mark.parametrize(
    ("pull", "window", "families"),
    [(0.0, 0.0, False), (0.7, 0.0, False), (0.7, 0.0, True), (0.7, 30.0, True), (0.7, 30.0, False)],
)
def test_smoothing_and_windows_match_their_loops(
    pull: float, window: float, families: bool
) -> None:
    rng = np.random.default_rng(0)
    events = rng.random((5, 12)) * 3
    expo = events + rng.random((5, 12)) * 10
    expo[1, 3:6] = events[1, 3:6] = 0.0  # buckets no life reached
    family = np.array([0, 1, 0, 2, 1]) if families else None
    m = 4.0
    h = _smoothed(events.copy(), expo.copy(), m, pull, family, window)
    prev = np.full(5, events[:, 0].sum() / expo[:, 0].sum())
    target = _local_rates_loop(events, expo, m, family, window)
    for b in range(12):
        prev = (events[:, b] + m * ((1 - pull) * prev + pull * target[:, b])) / (expo[:, b] + m)
        assert np.allclose(h[:, b], prev)
    steps = 8
    surv, held = _windows(h, steps)
    for s in range(5):
        for a in range(12):
            alive, time = 1.0, 0.0
            for j in range(steps):
                hz = h[s, min(a + j, 11)]
                time += alive * (1 - 0.5 * hz)  # trapezoid over the bucket
                alive *= 1 - hz
            assert np.isclose(surv[s, a], alive) and np.isclose(held[s, a], time)


def test_thin_ages_take_the_rate_of_the_nearest_ages_with_data() -> None:
    """A state used at a steady 2% a bucket while data lasts, then thin: pulled only towards the
    bucket before, its hazard sinks through the thin ages; pulled towards the local rate, it
    stays at the rate of the ages just younger."""
    k = 80
    events = np.full((1, k), 20.0)
    expo = np.full((1, k), 1000.0)
    expo[0, 30:] = 2.0  # thin: few lives reach these ages, none used there yet
    events[0, 30:] = 0.0
    chain = _smoothed(events.copy(), expo.copy(), 50.0, 0.0)[0]
    local = _smoothed(events.copy(), expo.copy(), 50.0, 0.7, None, 2000.0)[0]
    assert chain[79] < 0.25 * 0.02
    assert 0.015 < local[79] < 0.025


def test_a_falling_hazard_stays_low_at_thin_old_ages() -> None:
    """A state used mostly young (a chat turn answered at once) and never at well-observed middle
    ages: its mean over all ages is the young rate, and pulled towards it the thin old ages came
    back to it -- old blocks that were never coming back outranked young ones. Pulled towards the
    local rate they stay near the middle ages' (zero)."""
    k = 40
    events = np.zeros((1, k))
    expo = np.full((1, k), 1000.0)
    events[0, :4] = 300.0  # used at once, mostly
    expo[0, 30:] = 2.0  # thin old ages
    mean = events.sum() / expo.sum()
    to_mean = _smoothed(events.copy(), expo.copy(), 50.0, 0.7)[0]
    local = _smoothed(events.copy(), expo.copy(), 50.0, 0.7, None, 2000.0)[0]
    assert to_mean[39] > 0.3 * mean
    assert local[39] < 0.01 * mean
    assert local[20] < 0.01 * mean and to_mean[20] < 0.1 * mean  # well observed: the data decides


def test_a_rare_states_rate_comes_from_its_family() -> None:
    """State 1 (a rare hint) has a few lives and no use yet; its family (state 0, same place) is
    used at 1% a bucket. Alone, its hazard is the pooled bucket 0 falling away to nothing; with
    its family, the family's rate, less for its own lives without a use (10 buckets' worth of
    exposure against the prior's 20: two thirds of it). A state with plenty of data (2) keeps
    its own rate."""
    k = 20
    events = np.zeros((3, k))
    expo = np.full((3, k), 1000.0)
    events[0] = 10.0
    expo[1] = 0.5
    events[2] = 50.0
    family = np.array([0, 0, 1])
    alone = _smoothed(events.copy(), expo.copy(), 20.0, 0.7, None, 400.0)
    kin = _smoothed(events.copy(), expo.copy(), 20.0, 0.7, family, 400.0)
    assert alone[1, k - 1] < 1e-4
    assert 0.005 < kin[1, k - 1] < 0.008
    assert np.allclose(kin[2], alone[2]) and 0.045 < kin[2, k - 1] < 0.055


@pytest.mark.parametrize("seed", range(4))
def test_subtract_at_is_numpys_unbuffered_subtract(seed: int) -> None:
    """``refit``'s row subtraction equals ``np.subtract.at`` to the bit, rows named twice too."""
    rng = np.random.default_rng(seed)
    xd = rng.random((9, 3))
    rows = rng.integers(0, 9, size=7) if seed else np.arange(7)  # seed 0: no repeats
    w = rng.random((3, 7))
    want = xd.copy()
    np.subtract.at(want, rows, w.T)
    _subtract_at(xd, rows, w)
    assert np.array_equal(xd, want)


def test_one_bucket_ticks_age_lives_as_one_long_tick() -> None:
    """``tick`` one bucket at a time (its fast path) and across several buckets at once move
    the same open lives into the old pool."""
    a = LifeTable(width=4, buckets=8, tau=1e6, horizon=16, prior=1.0)
    b = LifeTable(width=4, buckets=8, tau=1e6, horizon=16, prior=1.0)
    for t in (a, b):
        t.grow(3)
    for start in range(0, 60, 2):
        for t in (a, b):
            t.tick(start)
            t.open(start % 3, start, 1 + start % 2)
    for now in range(60, 90):  # 7 buckets: within the ring of open lives (9), as a policy's
        a.tick(now)  # clock moves (an insert is at most a capacity, half the ring)
    b.tick(89)
    assert np.allclose(a._old, b._old) and np.allclose(a._old_sb, b._old_sb)
    assert np.allclose(a._open, b._open)
