"""The resident keys of one tier as *runs*: stretches of a chain that share their last use.

A learned policy (``kvtier.policy.density``) gives every resident block a state and an age set
at its last use. On a prefix cache most blocks are used together with their neighbours: a
request brings in a document's blocks together, and a later request that reuses the document
uses all of its blocks but the last few. A *run* is a stretch of consecutive keys of one chain
that share that (state, last use) -- its ``meta`` (``kvtier.policy.lifestates``). The policy
then does its bookkeeping per run instead of per key: a run is queued once, its lives open and
close with one call, and eviction cuts keys off its end (leaf first), as many as needed.

``RunIndex`` keeps the structure:

* a run is found by its first key (``first``, for the walk along a request's chain) or its last
  key (``last``, for a child's parent); ``res`` holds every resident key. No key -> run map:
  per-key work is set membership and C-level slicing.
* *prefix links* are between runs: a run's ``pkey`` is the key its first key hangs below, and
  ``kids`` the resident runs that hang below its last key. New keys always hang below a run's
  last key (a use splits a run at the end of the used part, ``split``), so every branch of the
  prefix tree is at a run's end, and protecting parents is per run: a run with resident kids
  must keep its last key. Met by an eviction it *waits* out of its queue; when its last kid
  leaves (``drop``), ``on_free`` hands it back to the policy to be queued first in line.
* a queue entry names a run and the meta it was queued with. A run that is split keeps the
  entry for the part that kept the old meta (``rest``): ``resolve`` follows it.

Assumes what a prefix cache guarantees: a key's parent is the same in every chain, so the
resident keys of a chain are a leading run of it. Not thread-safe (one policy).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any


class Run:
    """Consecutive keys of one chain sharing (state, last use): ``meta`` packs them (-1 once
    the run left, -2 while being re-stamped). ``kids``: resident child runs (hanging below the
    last key); ``pkey``: the key the first key hangs below (None: a root, or an orphan);
    ``rest``: runs split off that kept an older meta, by that meta (the queue entry of that meta
    is theirs); ``wait``: out of its queue until its kids left."""

    __slots__ = ("keys", "kids", "meta", "pkey", "rest", "wait")

    def __init__(self, keys: list[Any], meta: int, pkey: Any) -> None:
        self.keys = keys
        self.meta = meta
        self.kids: list[Run] | None = None
        self.pkey = pkey
        self.rest: dict[int, Run] | None = None
        self.wait = False


def resolve(run: Run, m: int) -> Run | None:
    """The live run a queue entry ``(run, m)`` stands for (following splits), or None."""
    while run.meta != m:
        rest = run.rest
        if not rest:
            return None
        nxt = rest.pop(m, None)
        if nxt is None:
            return None
        run = nxt
    return run


#: an eviction's record of one run it cut (to undo it): the run, the keys cut off its end
#: (empty: the run was sent to wait), its meta, whether the run left with them
Cut = tuple[Run, list[Any], int, bool]


class RunIndex:
    """The runs of one tier's resident keys (module docstring). The containers are public so
    that hot loops can alias them; the methods keep them consistent."""

    def __init__(self, on_free: Callable[[Run], None]) -> None:
        """``on_free(run)`` queues ``run`` again, first in line: a waiting parent whose last kid
        left, or the keys below a removed key."""
        self.res: set[Any] = set()
        self.first: dict[Any, Run] = {}  # a run's first key -> the run
        self.last: dict[Any, Run] = {}  # a run's last key -> the run
        self._on_free = on_free

    def __len__(self) -> int:
        return len(self.first)

    def add(self, runs: list[tuple[list[Any], int]], pkey: Hashable | None) -> list[Run]:
        """New runs ``runs`` (keys, meta), each hanging below the one before, the first below
        ``pkey`` (None: a root). The keys must not be resident."""
        first, last = self.first, self.last
        parent = last.get(pkey) if pkey is not None else None
        out = []
        for ks, m in runs:
            self.res.update(ks)
            r = Run(ks, m, pkey)
            if parent is not None:
                if parent.kids is None:
                    parent.kids = [r]
                else:
                    parent.kids.append(r)
            first[ks[0]] = r
            pkey = ks[-1]
            last[pkey] = r
            out.append(r)
            parent = r
        return out

    def split(self, r: Run, j: int, head_may_keep: bool) -> Run:
        """Split ``r`` after its first ``j`` keys (0 < j < len); returns the head part, with
        meta -2 (the caller stamps it, and keeps the old one if it needs it). The tail keeps
        ``r``'s meta and queue entry; the larger part keeps the object (fewer map updates), the
        tail always when ``head_may_keep`` is false (the head's new meta would equal the old
        one, and the old entry would name it)."""
        first, last = self.first, self.last
        ks = r.keys
        m = r.meta
        if head_may_keep and 2 * j >= len(ks):  # the head keeps the object; a new tail the entry
            tail = Run(ks[j:], m, ks[j - 1])
            del ks[j:]
            tail.kids, r.kids = r.kids, [tail]
            tail.wait, r.wait = r.wait, False
            last[tail.keys[-1]] = tail
            last[ks[-1]] = r
            first[tail.keys[0]] = tail
            if not tail.wait:
                if r.rest is None:
                    r.rest = {}
                r.rest[m] = tail
            r.meta = -2
            return r
        head = Run(ks[:j], -2, r.pkey)
        del ks[:j]
        r.pkey = head.keys[-1]
        head.kids = [r]
        if head.pkey is not None:
            p = last.get(head.pkey)
            if p is not None and p.kids and r in p.kids:
                kids = p.kids
                kids[kids.index(r)] = head
        first[head.keys[0]] = head
        first[ks[0]] = r
        last[head.keys[-1]] = head
        return head

    def merge(self, a: Run, b: Run) -> None:
        """``b`` (``a``'s only kid, about to get ``a``'s meta) joins ``a``; ``b``'s old queue
        entry goes stale (or resolves to a run split off it earlier)."""
        first, last = self.first, self.last
        del last[a.keys[-1]]
        del first[b.keys[0]]
        a.keys += b.keys
        a.kids = b.kids
        last[a.keys[-1]] = a
        b.meta = -1
        b.kids = None

    def drop(self, r: Run) -> None:
        """``r`` left (its keys are gone from the maps): unlink it from its parent; a waiting
        parent whose last kid this was is freed (``on_free``)."""
        r.meta = -1
        pk = r.pkey
        if pk is not None:
            p = self.last.get(pk)
            if p is not None and p.kids:
                kids = p.kids
                kids.remove(r)
                if not kids and p.wait:
                    p.wait = False
                    self._on_free(p)

    def find(self, key: Hashable) -> Run:
        """The run holding resident ``key``: O(1) when it ends or starts its run, else a scan of
        the runs (O(resident keys)); only the rare paths use it (``remove``, a parent in the
        middle of a run)."""
        r = self.last.get(key)
        if r is None:
            r = self.first.get(key)
        if r is not None:
            return r
        for r in self.first.values():
            if key in r.keys:
                return r
        raise AssertionError(f"resident key {key!r} in no run")  # pragma: no cover

    def hang(self, root: Run, pk: Hashable) -> Run | None:
        """Root run ``root`` hangs below resident ``pk``. If ``pk`` is not its run's last key,
        the run is split after it (both parts keep the meta) and the head, now a parent, is
        returned: the caller queues it."""
        p = self.last.get(pk)
        head = None
        if p is None:
            r = self.find(pk)
            m = r.meta
            p = head = self.split(r, r.keys.index(pk) + 1, False)
            p.meta = m
        root.pkey = pk
        if p.kids is None:
            p.kids = [root]
        else:
            p.kids.append(root)
        return head

    def detach(self, key: Hashable) -> int:
        """Take resident ``key`` out of its run; returns its meta. The keys below it in the run
        become an orphan run (no parent; queued first in line), its kid runs orphans."""
        r = self.find(key)
        first, last = self.first, self.last
        ks, m = r.keys, r.meta
        x = ks.index(key)
        self.res.discard(key)
        right = ks[x + 1 :]
        del first[ks[0]]
        del last[ks[-1]]
        if right:
            o = Run(right, m, None)
            o.kids, r.kids = r.kids, None
            first[right[0]] = o
            last[right[-1]] = o
            self._on_free(o)
        elif r.kids:
            for c in r.kids:
                c.pkey = None
            r.kids = None
        del ks[x:]
        if ks:
            first[ks[0]] = r
            last[ks[-1]] = r
            if r.wait:
                r.wait = False
                self._on_free(r)
        else:
            self.drop(r)
        return m

    def undo(self, cuts: Sequence[Cut]) -> None:
        """Undo an eviction's ``cuts`` (latest first); every run stops waiting and forgets its
        splits (the caller re-queues every run afresh)."""
        first, last, res = self.first, self.last, self.res
        for r, chunk, m, died in reversed(cuts):
            if not chunk:
                continue
            res.update(chunk)
            if died:
                r.meta = m
                first[chunk[0]] = r
                last[chunk[-1]] = r
                if r.pkey is not None:
                    p = last.get(r.pkey)
                    if p is not None:
                        p.kids = [*(p.kids or []), r]
            else:
                del last[r.keys[-1]]
                r.keys += chunk
                last[chunk[-1]] = r
        for r in first.values():
            r.wait = False
            r.rest = None
