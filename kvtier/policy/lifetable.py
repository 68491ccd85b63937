"""An online life table: how soon blocks in each state are used again, and what they are worth.

A block's *life* starts when it is used (inserted, hit, or requested again after eviction) and
ends at its next use. Every life has a *state* (a small int the policy derives from what it knew
at the start: the request's class, the block's place, how often it was used before) and is
measured in a *clock* the policy advances (new blocks inserted). This module learns, per state,
the hazard of a next use in each age bucket of width ``width``:

    h[s][b] = P(used in bucket b | state s, not used before bucket b)

from lives that ended (an event in the bucket where they ended, exposure in every bucket up to
it), lives still open (exposure in their completed buckets), and lives the policy forgot
(censored where they were). It is a *current* life table: every event and every exposure is
weighted by ``exp(-(now - when it happened) / tau)``, so the table follows a workload whose reuse
changes over time (on the Mooncake trace the chance that a reused document is used again within
200 requests goes from 3% in the first thousand requests to 60% in the last) instead of averaging
over cohorts that no longer behave alike. Hazards are smoothed with ``prior`` pseudo-observations
towards a mix of the previous bucket's hazard (bucket 0: the pooled hazard of every state's bucket
0) and a *local rate*: the state's events over its last ``mean_window`` x ``prior`` of exposure at
younger ages (where it has less, the rest at its mean over all ages). A state's mean is itself
smoothed with ``prior`` of exposure towards its family's (``families``: states that differ only
in the caller's hint), so a rare state's rate comes from its kin, not from a handful of lives.

From the hazards it computes the *hit density* of a block in state ``s`` at age ``a`` (LHD,
Beckmann et al., NSDI'18): the chance it is used within ``horizon`` divided by the time it is
expected to hold its space until then (its next use, or the horizon). The policy evicts the lowest
density first.

Costs: ``close``, ``open``, ``censor`` are O(1) (a few scalar updates, through flat memoryviews
of the arrays; weights are rebased every ``30 * tau`` of the clock so they never overflow);
``tick`` is O(states) per age bucket passed; ``refit`` is O(states x buckets x log(horizon /
width)), run by the policy every so often: its scans over the age buckets are
``kvtier.policy.lifescans`` (numpy, or the same operations in C: about 0.4 ms a refit at 76
states and 128 buckets, 1 ms in numpy). The horizon is rounded to a power of two buckets. Every
sum and product is formed as in the plain state-major formulas (same operands, same order), so
the results are the same to the bit, but for the pull's targets (``mean_pull``): their sums over
buckets run down the bucket-major columns, which may round differently in the last bit from a
state-major row sum.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from kvtier.policy.lifescans import (
    densities_bm,
    exposure_bm,
    retire_slot,
    running_min,
    smoothed_bm,
)


class LifeTable:
    """Online, recency-weighted hazards per (state, age bucket), and the hit densities they give.

    Not thread-safe (one policy, under the decider's lock). States are ints ``0 <= s`` that the
    caller allocates densely; ``grow`` makes room for a new one.
    """

    #: the weights' base moves when the clock is this many ``tau`` past it (exp(30) ~ 1e13)
    REBASE = 30.0

    def __init__(
        self,
        width: int,
        buckets: int,
        tau: float,
        horizon: int,
        prior: float = 100.0,
        unseen_decay: float = 1.0,
        mean_pull: float = 0.0,
        mean_window: float = 0.0,
    ) -> None:
        """``width``: age bucket width (clock units, >= 1); ``buckets``: buckets kept (the last
        takes every older age); ``tau``: recency weighting (clock units); ``horizon``: how far
        ahead density looks (clock units); ``prior``: smoothing strength (pseudo-observations);
        ``unseen_decay``: the factor a bucket's hazard is below the one before it, in buckets of
        ages older than the clock (no life can have reached them yet: 1 carries the last hazard
        seen on unchanged); ``mean_pull``: the share of the smoothing that pulls a bucket's
        hazard towards the state's local rate (the rest pulls towards the bucket before it);
        ``mean_window``: the exposure the local rate is taken over, in units of ``prior`` (0:
        the state's mean over all ages)."""
        self.width = max(1, int(width))
        self.buckets = max(2, int(buckets))
        self.tau = max(1e-9, float(tau))
        self.horizon = max(1, int(horizon))
        self.prior = max(1e-6, float(prior))
        self.unseen_decay = min(1.0, max(0.0, float(unseen_decay)))
        self.mean_pull = min(1.0, max(0.0, float(mean_pull)))
        self.mean_window = max(0.0, float(mean_window))
        self._base = 0  # weights are exp((t - base) / tau)
        k = self.buckets
        self._ring = k + 1
        self._n = 0  # states in use (rows allocated: ``len(self._ev)``)
        # per state (row): events by bucket, exposure differences (K + 1), open lives by start
        # bucket (a ring of K + 1 slots), open lives older than the ring (their weights, and
        # weights x start bucket), exposure in the last bucket beyond its first unit
        self._ev = np.zeros((0, k))
        self._xd = np.zeros((0, k + 1))
        self._open = np.zeros((0, self._ring))
        self._old = np.zeros(0)
        self._old_sb = np.zeros(0)
        self._last = np.zeros(0)
        self._views()
        self._cur = 0  # current start bucket (clock // width) as of the last ``tick``
        self._slots = np.arange(self._ring)
        self._ages = np.exp((np.arange(k) + 0.5) * self.width / self.tau)  # ``refit``'s weights
        #: hit density by [state, age bucket] (``refit``); all zero until the first refit
        self.density: npt.NDArray[np.float64] = np.zeros((0, k))
        self.hazard: npt.NDArray[np.float64] = np.zeros((0, k))
        #: a second table fed the same lives (``open``, ``close``, ``censor``), e.g. at the
        #: scale of a whole hierarchy; its owner grows, ticks and refits it
        self.also: LifeTable | None = None
        #: each state's family (``LifeStates.families``, read at ``refit``): a state's mean
        #: hazard is smoothed towards its family's; None (or too short): each state alone
        self.families: list[int] | None = None

    # -- bookkeeping -----------------------------------------------------------------------
    def grow(self, states: int) -> None:
        """Make room for states ``0 .. states - 1``."""
        if states <= self._n:
            return
        grown = np.zeros((states, self.buckets))
        grown[: self._n] = self.density[: self._n]
        self.density = grown
        self._n = states
        rows = len(self._ev)
        if states <= rows:
            return
        more = max(states, 2 * rows, 16) - rows  # rows double: amortised O(1) per state
        self._ev = np.vstack([self._ev, np.zeros((more, self._ev.shape[1]))])
        self._xd = np.vstack([self._xd, np.zeros((more, self._xd.shape[1]))])
        self._open = np.vstack([self._open, np.zeros((more, self._ring))])
        self._old = np.concatenate([self._old, np.zeros(more)])
        self._old_sb = np.concatenate([self._old_sb, np.zeros(more)])
        self._last = np.concatenate([self._last, np.zeros(more)])
        self._views()

    def _views(self) -> None:
        """Flat views of the arrays (row-major), for the O(1) updates: an element of a
        memoryview reads and writes as a Python float, several times cheaper than numpy's
        scalar indexing (the arithmetic is the same: IEEE doubles)."""
        self._ev_v = flat_view(self._ev)
        self._xd_v = flat_view(self._xd)
        self._open_v = flat_view(self._open)
        self._old_v = flat_view(self._old)
        self._old_sb_v = flat_view(self._old_sb)
        self._last_v = flat_view(self._last)

    def tick(self, now: int) -> bool:
        """The clock moved to ``now``: retire ring slots whose lives are now older than the ring
        (into the per-state ``old`` pool) and rebase weights if due. True when the current age
        bucket changed (every block's age bucket may have moved)."""
        b = now // self.width
        if b == self._cur:
            return False
        ring = self._ring
        # slot sb % ring held start bucket sb - ring until now: those lives are old
        if b == self._cur + 1:  # one slot: the general case's sum and product of one column
            # are 0 + it and 0 + it x (sb - ring), formed here without the fancy indexing
            retire_slot(self._open, self._old, self._old_sb, b % ring, float(b - ring))
        else:
            sbs = np.arange(max(self._cur + 1, b - ring + 1), b + 1)
            slots = sbs % ring
            cols = self._open[:, slots]
            self._old += cols.sum(axis=1)
            self._old_sb += cols @ (sbs - ring).astype(np.float64)
            self._open[:, slots] = 0.0
        self._cur = b
        if now - self._base > self.REBASE * self.tau:
            self._rebase(now)
        return True

    def _rebase(self, now: int) -> None:
        f = math.exp(-(now - self._base) / self.tau)
        self._base = now
        for a in (self._ev, self._xd, self._open, self._old, self._old_sb, self._last):
            a *= f

    def _unopen(self, state: int, start: int, a: float) -> None:
        sb = start // self.width
        if self._cur - sb >= self._ring:
            self._old_v[state] -= a
            self._old_sb_v[state] -= a * sb
        else:
            self._open_v[state * self._ring + sb % self._ring] -= a

    def open(self, state: int, start: int, count: int = 1) -> None:
        """``count`` lives of ``state`` start at ``start`` (the current clock)."""
        if self.also is not None:
            self.also.open(state, start, count)
        ring = self._ring
        self._open_v[state * ring + (start // self.width) % ring] += count * math.exp(
            (start - self._base) / self.tau
        )

    def close(self, state: int, start: int, now: int, count: int = 1) -> None:
        """``count`` lives of ``state`` that started at ``start`` end with a use at ``now``."""
        if self.also is not None:
            self.also.close(state, start, now, count)
        a = count * math.exp((start - self._base) / self.tau)
        self._unopen(state, start, a)
        b = (now - start) // self.width
        last = self.buckets - 1
        if b > last:  # the last bucket takes every older age: exposure for each bucket spent
            self._last_v[state] += a * (b - last)
            b = last
        self._ev_v[state * self.buckets + b] += a
        xd, row = self._xd_v, state * (self.buckets + 1)
        xd[row] += a
        xd[row + b + 1] -= a

    def censor(self, state: int, start: int, now: int, count: int = 1) -> None:
        """``count`` open lives are forgotten at ``now`` (exposure up to their age, no event)."""
        if self.also is not None:
            self.also.censor(state, start, now, count)
        a = count * math.exp((start - self._base) / self.tau)
        self._unopen(state, start, a)
        done = (now - start) // self.width
        if done > self.buckets:
            self._last_v[state] += a * (done - self.buckets)
            done = self.buckets
        if done:
            xd, row = self._xd_v, state * (self.buckets + 1)
            xd[row] += a
            xd[row + done] -= a

    # -- the table ---------------------------------------------------------------------------
    def refit(self, now: int) -> None:
        """Recompute hazards and densities as of ``now`` (call after ``tick(now)``)."""
        n = self._n
        if not n:
            return
        k, w, ring = self.buckets, self.width, self._ring
        # open lives: exposure in their completed buckets (start bucket sb: cur - sb of them)
        openw = self._open[:n]  # [n, ring], slot = sb % ring
        sb = self._cur - ((self._cur - self._slots) % ring)  # the start bucket each slot holds
        # completed buckets of a life started mid-bucket sb (the ring keeps no exact starts)
        done = np.clip(np.floor(now / w - sb - 0.5), 0, k).astype(np.int64)
        old = self._old[:n]
        # the last bucket: every bucket's worth of age spent past it, by lives closed, censored
        # and open (old lives of start bucket sb have cur - sb - k buckets past their first)
        tail = self._last[:n] + old * (self._cur - k) - self._old_sb[:n]
        # lives started at t: their bucket b happened at t + (b + 0.5) w (the weights carry
        # exp(t - base)), so exposure and events are weighted by how long ago they were
        f = self._ages * math.exp((self._base - now) / self.tau)
        # bucket-major ([bucket, state]) from here: the scans over buckets run down rows
        expo, events = exposure_bm(
            self._xd[:n], self._ev[:n], openw.sum(axis=1) + old, done, openw, tail, f
        )
        tot_x = expo[0].sum()
        pooled = events[0].sum() / tot_x if tot_x > 0 else 0.0
        fams = self.families
        family = None if fams is None or len(fams) < n else np.asarray(fams[:n], dtype=np.int64)
        h = smoothed_bm(
            events, expo, self.prior, pooled, self.mean_pull, family, self.mean_window * self.prior
        )
        seen = now // w + 1  # buckets of ages a life can have reached by now
        if seen < k and self.unseen_decay < 1.0:
            h[seen:] = h[seen - 1] * (self.unseen_decay ** np.arange(1, k - seen + 1))[:, None]
        # density over the horizon: P(used within it) / E[time held until used or horizon]
        steps = 1 << max(0, round(math.log2(max(1, self.horizon // w))))
        dens = densities_bm(h, steps)
        self.hazard = h.T
        self.density = dens.T


def flat_view(a: npt.NDArray[np.float64]) -> memoryview[float]:
    """A flat, writable view of C-ordered ``a`` whose elements are Python floats."""
    return (a.data if a.size else memoryview(bytearray())).cast("B").cast("d")


class DensityTable:
    """A ``LifeTable`` at the scale of ``blocks`` blocks, as a policy ranks by it: refit every
    ``refit_buckets`` age buckets of the clock (at least every ``min_refit`` of it), with its
    densities made non-increasing in age (the running minimum) and flat (``dens[s * buckets +
    bucket]``, for hot loops), and tilted towards recency if asked (``tilt``). ``epoch`` moves
    whenever the age buckets or densities moved."""

    def __init__(
        self,
        blocks: int,
        *,
        width_fraction: float,
        buckets: int,
        tau_fraction: float,
        horizon_fraction: float,
        prior_fraction: float,
        refit_buckets: int,
        min_refit: int,
        unseen_decay: float = 1.0,
        mean_pull: float = 0.0,
        mean_window: float = 0.0,
    ) -> None:
        blocks = max(1, blocks)
        self.table = LifeTable(
            width=max(1, int(blocks * width_fraction)),
            buckets=buckets,
            tau=max(1.0, blocks * tau_fraction),
            horizon=max(1, int(blocks * horizon_fraction)),
            prior=max(1.0, blocks * prior_fraction),
            unseen_decay=unseen_decay,
            mean_pull=mean_pull,
            mean_window=mean_window,
        )
        self.width = self.table.width
        self.buckets = self.table.buckets
        self.epoch = 0
        self._every = max(self.width * refit_buckets, min_refit)
        self.next_refit = self._every  # the clock at which the next refit is due
        self.array = np.zeros((0, self.buckets))
        self.dens: memoryview[float] = flat_view(self.array)
        self.blocks = blocks
        #: per age bucket, the factor the densities are ranked at (``tilt``); None: 1
        self.recency: npt.NDArray[np.float64] | None = None

    def tilt(self, strength: float) -> None:
        """From now on rank by the densities times ``exp(-strength x age / blocks)`` (ages at
        their buckets' middles), these and every refit's: a prior towards recency order, for a
        table that learns from few lives (``kvtier.policy.fallback``). Still non-increasing in
        age. Call ``epoch``'s users' repricing after it (the densities moved)."""
        ages = (np.arange(self.buckets) + 0.5) * self.width / self.blocks
        self.recency = np.exp(-strength * ages)
        self.array = self.array * self.recency
        self.dens = flat_view(self.array)
        self.epoch += 1

    def grow(self, states: int) -> None:
        """Room for states ``0 .. states - 1`` (table rows and densities)."""
        self.table.grow(states)
        if len(self.array) < states:
            grown = np.zeros((states, self.buckets))
            grown[: len(self.array)] = self.array
            self.array = grown
            self.dens = flat_view(grown)

    def advance(self, now: int) -> bool:
        """The clock moved to ``now``: tick, refit when due. True when ``epoch`` moved."""
        moved = self.table.tick(now)
        if now >= self.next_refit:
            self.table.refit(now)
            self.next_refit = now + self._every
            self.array = running_min(self.table.density.T)
            if self.recency is not None:
                self.array *= self.recency
            self.dens = flat_view(self.array)
            moved = True
        if moved:
            self.epoch += 1
        return moved

    def density(self, s: int, age: int) -> float:
        """The density of state ``s`` at ``age`` (clock units)."""
        b = age // self.width
        return self.dens[s * self.buckets + (b if b < self.buckets else self.buckets - 1)]
