"""Learned admission: how a new block enters the cache, from how often its class came back.

On prefix-reuse traces, reuse is decided per *request* more than per block: a document is either
asked about again (all of it) or never, and a cache that could tell the two apart at insert time
would keep the first and drop the second at once. Two things known at insert time carry the
signal: the request itself -- its kind (document ingestion vs. chat turn), its output length,
whether it extended a cached prefix -- and a block's place in it (a request's last block is
often partial, so the next request's differs). Which value means what differs from one
deployment to the next, so nothing is hard-coded: a policy labels each new key with a class
(the caller's *hint* for the request, any hashable, plus the key's place), and this module
learns each class's reuse rate online:

* every new key carries its class while the hierarchy knows the key (resident in some tier, or
  in the first tier's ghost list);
* the first time such a key is used again (a hit, a ghost hit, or its return from a lower tier)
  its class scores one reuse, and the key drops its label;
* the verdict of a class: ``COLD`` when its keys came back at under ``cold_ratio`` (0.4) times
  the rate of all labelled new keys, ``HOT`` when over ``hot_above`` (70%) of them did, else
  ``NORMAL`` -- and ``NORMAL`` until ``min_samples`` keys of the class were seen. Counts halve
  every ``window`` new keys of a class, so verdicts follow a changing workload.

``COLD`` is relative because it means "evict these before anything else": that pays only when
the class is reused clearly less than what would be evicted instead. A fixed cut (10%) judged a
chat turn's third-to-last block cold on an agent workload (8% reused, against 9% for all new
keys), and S3-FIFO fell to 0.98x LRU there; in a workload where every class is rarely reused it
would make every class cold, and eviction newest-first.

The policy decides what a verdict means (S3-FIFO: ``COLD`` keys are the first victims, ``HOT``
keys skip probation). A class without signal stays ``NORMAL``, so a hint can only let the policy
act where the workload shows a clear pattern.

``output_class`` is the label the simulator derives from a trace's ``output_length`` (an engine
storing a request's blocks when it ends knows it too): on the Mooncake trace a request whose
first blocks are new and whose answer is short is a document that will be asked about again 89%
of the time, one with a long answer 2-12% (docs/simulation.md).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, ClassVar, Final, Generic

from kvtier.policy.base import K

COLD: Final = 0
NORMAL: Final = 1
HOT: Final = 2
VERDICTS = ("cold", "normal", "hot")


def output_class(output_tokens: int | None, extends_cached: bool) -> tuple[int, bool] | None:
    """The reuse class the simulator passes (an engine storing a request's blocks when it ends
    can pass it too): the generated length in 25-token buckets (capped at 200+) and whether the
    request extended a cached prefix. ``None`` (no label) when the output length is unknown."""
    if output_tokens is None:
        return None
    return (min(max(output_tokens, 0) // 25, 8), extends_cached)


class ReuseClasses(Generic[K]):
    """Online per-class reuse rates (see the module docstring). Not thread-safe.

    The policy keeps each new key's label itself (S3-FIFO packs it into its per-key counter, so
    a labelled key costs no extra lookup) and calls ``new``/``reused`` with the class id. One
    instance serves a whole hierarchy: the first tier's policy labels keys, and the labels travel
    with the keys between tiers through ``down`` (victims on their way to the tier below) and
    ``up`` (keys leaving a lower tier, perhaps promoted back up). Both are bounded.
    """

    #: a class needs this many new keys before its verdict leaves ``NORMAL``
    min_samples: int = 50
    #: ``COLD``: reused at under this share of the overall rate (all labelled new keys)
    cold_ratio: float = 0.4
    #: ``HOT``: more than this share of the class's new keys came back
    hot_above: float = 0.7
    #: classes learned at most (a class variable: S3-FIFO reads it off the class)
    max_classes: ClassVar[int] = 4096

    def __init__(self, window: int, handoff: int) -> None:
        """``window``: new keys of one class after which its counts are halved; ``handoff``:
        most labels kept in transit (``up``, ``down``) before they are dropped."""
        self.window = max(2, window)
        self.handoff = max(1, handoff)
        self._ids: dict[Hashable, int] = {}
        self._new: list[float] = [0.0]  # by class id; id 0 is "unlabelled"
        #: first reuses by class id; policies add 1.0 per first reuse of a labelled key (or
        #: call ``reused``) -- a plain list, as this is their hot path
        self.reuses: list[float] = [0.0]
        self.down: dict[K, int] = {}
        self.up: dict[K, int] = {}
        self._cold_cut = 0.0  # cold_ratio x the overall rate, as of the last refresh
        self._since_refresh = 0

    def refresh(self) -> None:
        """Recompute the overall reuse rate the ``COLD`` cut follows. Done after every
        ``min_samples`` + (number of classes) new keys, so it costs O(1) per key (policies count
        reuses straight into ``reuses``, so it cannot be kept as a running sum)."""
        self._since_refresh = 0
        new = sum(self._new)
        self._cold_cut = self.cold_ratio * (sum(self.reuses) - self.reuses[0]) / new if new else 0.0

    def cid(self, cls: Hashable) -> int:
        """The small-int id (>= 1) of class ``cls``; 0 (unlabelled) once ``max_classes`` exist
        (a caller passing per-request ids as classes gets no learning, and no memory growth)."""
        i = self._ids.get(cls)
        if i is None:
            if len(self._ids) >= self.max_classes:
                return 0
            i = self._ids[cls] = len(self._new)
            self._new.append(0.0)
            self.reuses.append(0.0)
        return i

    def verdict(self, cid: int) -> int:
        """``COLD``, ``NORMAL`` or ``HOT`` for class id ``cid`` (0, unlabelled: ``NORMAL``)."""
        n = self._new[cid]
        if n < self.min_samples or not cid:
            return NORMAL
        p = (self.reuses[cid] + 1.0) / (n + 2.0)
        if p < self._cold_cut:
            return COLD
        return HOT if p > self.hot_above else NORMAL

    def admit(self, cid: int, n: int) -> int:
        """``n`` new keys of class ``cid`` are admitted: counts them (as ``new``) and returns
        the verdict to place them by (``verdict``, one call instead of two on a hot path)."""
        if not cid:
            return NORMAL
        self._since_refresh += n
        if self._since_refresh >= self.min_samples + len(self._new):
            self.refresh()
        count = self._new[cid] + n
        if count >= self.window:
            count /= 2
            self.reuses[cid] /= 2
        self._new[cid] = count
        return self.verdict(cid)

    def new(self, cid: int, n: int) -> None:
        """``n`` new keys were admitted for class ``cid`` (0, unlabelled: ignored)."""
        self.admit(cid, n)

    def reused(self, cid: int) -> None:
        """A key labelled ``cid`` was used again (first time since its admission)."""
        self.reuses[cid] += 1.0

    def summary(self, limit: int = 16) -> list[dict[str, Any]]:
        """The ``limit`` classes with the most new keys: class, counts, reuse rate, verdict."""
        names = {i: c for c, i in self._ids.items()}
        order = sorted(names, key=lambda i: -self._new[i])[:limit]
        return [
            {
                "class": repr(names[i]),
                "new": round(self._new[i], 1),
                "reused": round(self.reuses[i], 1),
                "reuse_rate": round(self.reuses[i] / self._new[i], 3) if self._new[i] else 0.0,
                "verdict": VERDICTS[self.verdict(i)],
            }
            for i in order
        ]

    def send(self, store: dict[K, int], key: K, cid: int) -> None:
        """Put ``key``'s label in transit (``store`` is ``up`` or ``down``), bounded."""
        if len(store) >= self.handoff:
            store.clear()  # labels lost: those keys read as unlabelled, nothing worse
        store[key] = cid
