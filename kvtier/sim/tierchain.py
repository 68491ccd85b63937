"""Exclusive tiers with demotion: the tiers of a simulated cluster (``kvtier.sim.cluster``).

A block lives in one tier of a ``TierChain`` at a time. Serving a request's chain (``serve``)
promotes the blocks found below the first tier (they move up), computes the missing ones, and
tells the first tier's policy about the whole chain; room is made first (``evict`` with the
chain pinned while part of it is resident), and victims are demoted one tier down, the last tier
dropping them. A demotion larger than a tier passes its excess on down (an empty tier passes
all). ``locate`` reads where the chain's blocks are *before* serving, so the caller credits hits
to the tier that held each block (``kvtier.sim.cluster``, for each node and the shared tiers).
One-node replays run the store's own decisions instead (``kvtier.sim.storemodel``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

from kvtier.policy import EvictionPolicy
from kvtier.policy.base import always


class TierChain:
    """Exclusive tiers, fastest first, each with its own policy (module docstring)."""

    def __init__(self, pols: Sequence[EvictionPolicy[int]], caps: Sequence[int]) -> None:
        """``pols[t]`` tracks tier ``t`` of ``caps[t]`` blocks."""
        self.pols = list(pols)
        self.caps = list(caps)
        self.where: dict[int, int] = {}  # resident block -> its tier
        n = len(self.pols)
        self.promoted = [0] * n  # blocks read out of tier t (t > 0) and moved up
        self.written = [0] * n  # blocks inserted or demoted into tier t
        self.evicted = [0] * n  # blocks evicted out of tier t

    def locate(self, blocks: Sequence[int]) -> list[int | None]:
        """The tier holding each block now (None: not here)."""
        return list(map(self.where.get, blocks))

    def serve(self, chain: Sequence[int], located: list[int | None], hint: Hashable) -> None:
        """After a request with ``chain`` (its blocks the first tier keeps, prefix order) was
        served, with ``located`` its blocks' tiers before (``locate``): promote the blocks found
        below the first tier, admit the missing ones, and count the chain as an access there."""
        pols = self.pols
        here = located.count(0)
        if here + located.count(None) == len(located):  # nothing below the first tier
            new = (
                [k for k, t in zip(chain, located, strict=True) if t is None] if here else [*chain]
            )
        else:
            new = []
            where = self.where
            for k, t in zip(chain, located, strict=True):
                if t is None:
                    new.append(k)
                elif t:  # promote: exclusive tiers, the block moves up
                    pols[t].remove(k)
                    del where[k]
                    self.promoted[t] += 1
                    new.append(k)
        if new:
            self.admit(0, new, chain, len(new) < len(chain), hint)
        else:
            pols[0].insert(chain, hint)  # all resident: the whole chain counts as accessed

    def admit(
        self,
        t: int,
        keys: list[int],
        chain: Sequence[int] = (),
        pin: bool = False,
        hint: Hashable | None = None,
    ) -> None:
        """Make ``keys`` resident in tier ``t``, demoting victims further down.

        ``chain`` (first tier only) is the served request's chain: the policy is told about the
        whole chain in prefix order, and with ``pin`` (some of it is resident already) its
        blocks are pinned while room is made. Demoted ``keys`` (lower tiers) come in prefix
        order; those beyond the tier's capacity pass on down with its own victims (a bulk
        demotion larger than a tier spills, it is not lost).
        """
        cap = self.caps[t]
        overflow: list[int] = []
        if len(keys) > cap:
            keys, overflow = keys[:cap], keys[cap:]
            if t == 0:
                overflow = []  # the served request's tail does not fit: it is not kept
        down: list[int] = overflow
        if keys:
            pol = self.pols[t]
            need = len(pol) + len(keys) - cap
            if need > 0:
                victims = pol.evict(need, not_in(chain) if pin else always)
                assert victims is not None, "policy refused to evict unpinned blocks"
                for v in victims:
                    del self.where[v]
                self.evicted[t] += len(victims)
                victims.reverse()  # policies give leaf-first victims; tiers take prefix order
                down = overflow + victims if overflow else victims
            pol.insert(chain or keys, hint)
            self.where.update(dict.fromkeys(keys, t))
            self.written[t] += len(keys)
        if down and t + 1 < len(self.pols):
            self.admit(t + 1, down)


def not_in(chain: Sequence[int]) -> Callable[[int], bool]:
    """``evictable`` predicate pinning the blocks of the request being served."""
    pinned = set(chain)
    return lambda k: k not in pinned
