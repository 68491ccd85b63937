"""S3-FIFO (Yang et al., SOSP'23), made prefix-aware, with learned admission.

Three FIFO queues: a *small* probation queue that new blocks enter, a *main* queue for blocks
that were hit while on probation (or that come back soon after being dropped), and a *ghost*
list of recently dropped keys (no data). Every resident key carries a 2-bit hit counter.
Eviction takes from ``small`` while it holds more than its share: a hit block moves to ``main``,
an unhit one is dropped (and remembered in ``ghost``). From ``main``, a hit block is reinserted
with its counter decremented (CLOCK-like), an unhit one is dropped. So one-shot tails of long
prompts leave quickly, and shared prefixes, hit again and again, stay.

Prefix awareness: a request's chain is queued *leaf first* (the root enters last), so within one
chain the leaf leaves the FIFO before its parent, and a parent's counter is never below its
child's (every hit on a child is a hit on its parent too). The block-level variant
``s3fifo-block`` queues parent first, as a plain block cache would; it drops parents before their
children and does worse than LRU at small capacities. It breaks the prefix contract, so it is
not in the store's registry: only the simulator offers it, as the comparison baseline.

Learned admission (``kvtier.policy.admission``): every new key is labelled with a class -- the
``hint`` of its ``insert`` (the request's reuse class, if the caller gives one) and its place
among the request's new keys (each of the last ``TAIL_CLASSES`` = 4 new keys has a class of its
own, the rest share one). The policy learns each class's reuse rate from later hits, ghost hits
and returns from a lower tier. A ``COLD`` class's new keys (reused at under 0.4x the rate of all
new keys) enter probation at its *front*, the first victims unless hit soon; a ``HOT`` class's
(over 70%) skip probation for the main queue, so a document that will be asked about again
survives the wait for its first reuse; the rest enter probation as usual. On the Mooncake trace
a request's last new block is reused 5% of the time (its last block is partial, the next
request's differs) and learns to be ``COLD``; on a chat workload the same place is reused with
the next turn and stays ``NORMAL``. A fixed rule (the last 3 new keys as first victims) did as
well on Mooncake and fell to 0.86x LRU on synthetic chat; the learned one stays within 0.6% of
LRU on every synthetic workload (``docs/simulation.md``).

In a hierarchy the classes are shared: ``feed_by_demotion(upper)`` makes a lower tier use the
upper tier's, and each victim passed down carries its label, so the lower tier places it by its
class's verdict too (an ``insert`` there is a batch of victims, not one request's chain).

The ghost list is a plain dict of key -> drop number: a key is in it while fewer than its
length of later keys were dropped, and stale entries are cleared in bulk when the dict reaches
twice that length (an ordered dict costs 3-5x more per drop, on the simulator's hot path).

``insert`` accepts keys that are already resident (the served request's whole chain): those
count as hits. Eviction work is bounded: each key is moved at most ``MAX_FREQ + 1`` times per
eviction pass, and pinned (non-evictable) keys are rotated to the back at most once per victim.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Hashable, Sequence
from itertools import islice
from typing import Any, ClassVar

from kvtier.policy.admission import COLD, HOT, ReuseClasses
from kvtier.policy.base import EvictionPolicy, K, always

MAX_FREQ = 3
#: the last TAIL_CLASSES new keys of an insert each have a class of their own (by place)
TAIL_CLASSES = 4
#: a key's counter is ``hits | class_id << LABEL_SHIFT``; a labelled key has no hits yet
LABEL_SHIFT = 2
HITS = (1 << LABEL_SHIFT) - 1
#: a ghost entry is ``drop number << GHOST_SHIFT | class id`` (room for every class id)
GHOST_SHIFT = ReuseClasses.max_classes.bit_length()
LABELS = (1 << GHOST_SHIFT) - 1


class S3FIFO(EvictionPolicy[K]):
    """Prefix-aware S3-FIFO. Tuned on the Mooncake trace (see ``docs/simulation.md``)."""

    name = "s3fifo"
    #: share of the capacity the probation queue may hold before eviction takes from it first
    small_fraction: ClassVar[float] = 0.2
    #: ghost list length as a multiple of the capacity
    ghost_factor: ClassVar[float] = 3.0
    #: queue a chain leaf first (prefix-aware) or parent first (block-level)
    leaf_first: ClassVar[bool] = True
    #: label new keys and learn their classes' reuse (off: plain S3-FIFO admission)
    learned: ClassVar[bool] = True

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._small: OrderedDict[K, None] = OrderedDict()
        # probation's first victims (cold keys), a stack: the newest leaf leaves first
        self._cold: OrderedDict[K, None] = OrderedDict()
        self._main: OrderedDict[K, None] = OrderedDict()
        # dropped keys -> drop number << GHOST_SHIFT | class id (0: none); a key is in the ghost
        # list while fewer than ``_ghost_cap`` keys were dropped after it (older entries are
        # stale, cleared in bulk now and then)
        self._ghost: dict[K, int] = {}
        self._drops = 0
        # per resident key: hits (2 bits, at most MAX_FREQ) or, until its first reuse, the id
        # of the request class that admitted it (shifted by LABEL_SHIFT)
        self._freq: dict[K, int] = {}
        self._small_cap = max(1, int(capacity * self.small_fraction))
        self._ghost_cap = max(1, int(capacity * self.ghost_factor))
        self._classes: ReuseClasses[K] = ReuseClasses(
            window=max(1000, 8 * capacity), handoff=max(1000, capacity)
        )
        self._ids_by_hint: dict[Hashable | None, list[int]] = {}
        self._demoted = False  # fed by the demotions of the tier above (feed_by_demotion)
        self._passes_down = False  # a tier below takes this one's victims (and labels)

    def feed_by_demotion(self, upper: EvictionPolicy[K] | None = None) -> EvictionPolicy[K]:
        self._demoted = True  # an insert is a batch of victims: no request, no tail
        if isinstance(upper, S3FIFO):  # victims keep the verdict of their request's class
            self._classes = upper._classes
            upper._passes_down = True
        return self

    def insert(self, keys: Sequence[K], hint: Hashable | None = None) -> None:
        if self._demoted:
            self._insert_victims(keys)
            return
        freq = self._freq
        ghost = self._ghost
        small = self._small
        classes = self._classes
        up = classes.up
        reuses = classes.reuses
        admit = classes.admit
        # new keys are labelled (request class, place): the last TAIL_CLASSES new keys of the
        # chain (the tail) have a class each, the rest (the body) share one
        cids = self._ids_by_hint.get(hint) or self._class_ids(hint)
        fresh = max(self._drops - self._ghost_cap + 1, 1) << GHOST_SHIFT  # _ghost_floor()
        body_label = cids[TAIL_CLASSES] << LABEL_SHIFT
        body: list[K] = []  # placed after the loop, together
        add_body = body.append
        place = 0  # of the next new key, from the leaf end; TAIL_CLASSES once past a resident key
        tail = TAIL_CLASSES
        front: list[K] = []
        main = self._main
        for k in reversed(keys) if self.leaf_first else keys:
            f = freq.get(k)
            if f is not None:
                if f < MAX_FREQ:
                    freq[k] = f + 1
                elif f > MAX_FREQ:  # labelled: its first reuse
                    reuses[f >> LABEL_SHIFT] += 1.0
                    freq[k] = 1
                place = tail  # the keys before a resident key are not a new tail
                continue
            if (g := ghost.pop(k, 0)) >= fresh:  # a ghost hit
                if c := g & LABELS:
                    reuses[c] += 1.0
                main[k] = None
                freq[k] = 0
                place = tail
                continue
            if up and (c := up.pop(k, 0)):  # back from a lower tier: a reuse
                reuses[c] += 1.0
            if place == tail:
                freq[k] = body_label
                add_body(k)
                continue
            c = cids[place]
            place += 1
            freq[k] = c << LABEL_SHIFT
            verdict = admit(c, 1)
            if verdict == COLD:
                front.append(k)
            elif verdict == HOT:
                main[k] = None  # skips probation: it will likely be asked for again
            else:
                small[k] = None
        if body:
            verdict = admit(cids[TAIL_CLASSES], len(body))
            if verdict == COLD:
                front.extend(body)
            else:  # HOT keys skip probation: they will likely be asked for again
                queue = main if verdict == HOT else small
                for k in body:  # (a loop: OrderedDict.update is 2.5x slower per key)
                    queue[k] = None
        if front:  # parent first, so the leaf is on top
            cold = self._cold
            for k in reversed(front):
                cold[k] = None

    def _class_ids(self, hint: Hashable | None) -> list[int]:
        """Class ids of a new key of a request with ``hint``, by place (the body's last)."""
        cids = self._ids_by_hint.get(hint)
        if cids is None:
            if self.learned:
                cids = [self._classes.cid((hint, p)) for p in range(TAIL_CLASSES + 1)]
            else:
                cids = [0] * (TAIL_CLASSES + 1)
            if len(self._ids_by_hint) < ReuseClasses.max_classes:
                self._ids_by_hint[hint] = cids
        return cids

    def _insert_victims(self, keys: Sequence[K]) -> None:
        """``insert`` for a tier fed by demotions: ``keys`` are victims of the tier above, in
        prefix order. Each goes where the verdict of its request's class sends it."""
        freq, ghost, small, main = self._freq, self._ghost, self._small, self._main
        classes = self._classes
        down = classes.down
        front: list[K] = []
        fresh = self._ghost_floor()
        for k in reversed(keys) if self.leaf_first else keys:
            f = freq.get(k)
            if f is not None:
                if f < MAX_FREQ:
                    freq[k] = f + 1
                continue
            c = down.pop(k, 0) if down else 0
            freq[k] = c << LABEL_SHIFT
            if ghost.pop(k, 0) >= fresh:
                main[k] = None
                continue
            verdict = classes.verdict(c)
            if verdict == HOT:
                main[k] = None
            elif verdict == COLD:
                front.append(k)
            else:
                small[k] = None
        if front:
            cold = self._cold
            for k in reversed(front):
                cold[k] = None

    def access(self, keys: Sequence[K]) -> None:
        freq = self._freq
        for k in keys:
            f = freq.get(k)
            if f is not None:
                if f < MAX_FREQ:
                    freq[k] = f + 1
                elif f > MAX_FREQ:
                    self._classes.reused(f >> LABEL_SHIFT)
                    freq[k] = 1

    def refresh(self, keys: Sequence[K]) -> None:
        """Move resident ``keys`` behind everything in their queue, leaf first (the root ends
        last), counters untouched; a cold one moves to probation's back (a parent of stored
        blocks must not be a first victim before them)."""
        freq, small, cold, main = self._freq, self._small, self._cold, self._main
        for k in reversed(keys):
            if k not in freq:
                continue
            if k in main:
                main.move_to_end(k)
            elif k in cold:
                del cold[k]
                small[k] = None
            elif k in small:
                small.move_to_end(k)

    def remove(self, key: K) -> None:
        f = self._freq.pop(key, None)
        if f is None:
            return
        if f > MAX_FREQ and self._demoted:  # it may be going up: its label goes along
            self._classes.send(self._classes.up, key, f >> LABEL_SHIFT)
        for queue in self._small, self._cold, self._main:
            if key in queue:
                del queue[key]
                return

    def _dropped(self, k: K, f: int) -> None:
        """Victim ``k`` (counter ``f``, non-zero) is passed down: a labelled one keeps its label."""
        if f > MAX_FREQ:
            self._classes.send(self._classes.down, k, f >> LABEL_SHIFT)

    def evict(self, n: int, evictable: Callable[[K], bool]) -> list[K] | None:
        """All-or-nothing on the resident set (queue order may age during a failed attempt).

        Pinned keys are rotated to the back of their queue, each at most once between two steps
        that lower some key's counter or take a victim (so the work is bounded by the counters'
        sum plus the victims). ``always`` takes a faster path with the same choices.
        """
        if n <= 0:
            return []
        freq = self._freq
        if n > len(freq):
            return None
        if evictable is always:
            return self._evict_unpinned(n)
        small, cold, main, ghost = self._small, self._cold, self._main, self._ghost
        small_cap = self._small_cap
        victims: list[K] = []
        passes_down = self._passes_down
        drops = self._drops
        # queue lengths kept in locals: this loop is the simulator's hot path
        ns, nm, left = len(small) + len(cold), len(main), n
        skip_small = skip_main = 0
        while left:
            main_open = skip_main < nm
            if skip_small < ns and (ns >= small_cap or not main_open):
                # probation: its cold keys first (a pinned one rotates into small)
                k = cold.popitem()[0] if cold else small.popitem(last=False)[0]
                f = freq[k]
                if f & HITS:
                    freq[k] = 0
                    main[k] = None
                    ns -= 1
                    nm += 1
                    skip_small = skip_main = 0  # progress: pinned keys may be passed again
                    continue
                if not evictable(k):
                    small[k] = None
                    skip_small += 1
                    continue
                del freq[k]
                ns -= 1
                drops += 1
                ghost[k] = drops << GHOST_SHIFT | f >> LABEL_SHIFT
            elif main_open:
                k, _ = main.popitem(last=False)
                f = freq[k]
                if f & HITS:
                    freq[k] = f - 1
                    main[k] = None
                    skip_small = skip_main = 0
                    continue
                if not evictable(k):
                    main[k] = None
                    skip_main += 1
                    continue
                del freq[k]
                nm -= 1
            else:  # every resident key is pinned: restore, back at the front, unhit
                for v in reversed(victims):
                    freq[v] = (ghost.pop(v, 0) & LABELS) << LABEL_SHIFT
                    small[v] = None
                    small.move_to_end(v, last=False)
                return None
            victims.append(k)
            if f and passes_down:
                self._dropped(k, f)
            left -= 1
            skip_small = skip_main = 0
        self._drops = drops
        if len(ghost) > 2 * self._ghost_cap:
            self._trim_ghost()
        return victims

    def _evict_unpinned(self, n: int) -> list[K]:
        """``evict`` when nothing is pinned (``n <= len(self)``): no rotations, no restore.

        ``main`` is read in passes: one iterator walks it from the front, lowering the counters
        of hit keys and taking unhit ones, and the queue is updated after the walk (victims out,
        hit keys to the back in the order met) -- the order one key at a time would give, as a
        key moved to the back is not met again before the rest of the queue. Probation is read
        the same way, as many keys at a time as leave it before it is within its share (cold
        keys first, newest first)."""
        small, cold, main, ghost = self._small, self._cold, self._main, self._ghost
        freq = self._freq
        small_cap = self._small_cap
        passes_down = self._passes_down
        drops = self._drops
        nc, ns, nm = len(cold), len(small) + len(cold), len(main)
        victims: list[K] = []
        append = victims.append
        while n:
            if ns and (ns >= small_cap or not nm):
                # probation while over its share (else one key: main is empty): its cold keys
                # first, newest first (a stack), then the rest from the front
                queue, keys = (cold, reversed(cold)) if nc else (small, iter(small))
                first = len(victims)
                promoted: list[K] = []
                for k in islice(keys, ns - small_cap + 1 if ns >= small_cap else 1):
                    f = freq[k]
                    if f & HITS:
                        freq[k] = 0
                        promoted.append(k)
                        continue
                    del freq[k]
                    drops += 1
                    ghost[k] = drops << GHOST_SHIFT | f >> LABEL_SHIFT
                    append(k)
                    if passes_down and f:
                        self._dropped(k, f)
                    n -= 1
                    if not n:
                        break
                for k in promoted:
                    del queue[k]
                    main[k] = None
                for k in victims[first:]:
                    del queue[k]
                left = len(promoted) + len(victims) - first
                ns -= left
                nc -= left if nc else 0
                nm += len(promoted)
                continue
            # main (probation is within its share, or empty): until n victims or a full pass
            first = len(victims)
            again: list[K] = []
            for k in main:
                f = freq[k]
                if f & HITS:  # another round (moved after the pass)
                    freq[k] = f - 1
                    again.append(k)
                    continue
                append(k)
                n -= 1
                if not n:
                    break
            for k in victims[first:]:
                del main[k]
                f = freq.pop(k)
                if passes_down and f:
                    self._dropped(k, f)
            nm -= len(victims) - first
            move = main.move_to_end
            for k in again:
                move(k)
        self._drops = drops
        if len(ghost) > 2 * self._ghost_cap:
            self._trim_ghost()
        return victims

    def _ghost_floor(self) -> int:
        """Ghost values at or above this are live entries (dropped among the last capacity)."""
        return max(self._drops - self._ghost_cap + 1, 1) << GHOST_SHIFT  # 0: not in the list

    def _trim_ghost(self) -> None:
        """Clear the ghost list's stale entries (called when it holds twice its length)."""
        fresh = self._ghost_floor()
        self._ghost = {k: g for k, g in self._ghost.items() if g >= fresh}

    def describe(self) -> dict[str, Any]:
        """Queue sizes, and (first tier) the learned request classes, most frequent first."""
        out: dict[str, Any] = {
            "small": len(self._small),
            "cold": len(self._cold),
            "main": len(self._main),
            "ghost": min(len(self._ghost), self._ghost_cap),
        }
        if not self._demoted and self.learned:
            out["classes"] = self._classes.summary()
        return out

    def resident(self) -> Collection[object]:
        return self._freq


class BlockS3FIFO(S3FIFO[K]):
    """S3-FIFO as a plain block cache (paper defaults, parent first): prefix-unaware baseline."""

    name = "s3fifo-block"
    small_fraction = 0.1
    ghost_factor = 0.9
    leaf_first = False
    learned = False
