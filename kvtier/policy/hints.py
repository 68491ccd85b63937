"""Reuse-class hints: the label a caller may pass with a store (``TieredStore.store(...,
reuse_class=)``) and the one the simulator passes for each request.

A hint is any hashable that tells kinds of requests apart. Policies may use it or ignore it
(``EvictionPolicy.insert``'s ``hint``); the default policy ignores it, so a hint never changes
what the store keeps unless a policy that reads hints is configured.
"""

from __future__ import annotations


def output_class(output_tokens: int | None, extends_cached: bool) -> tuple[int, bool] | None:
    """The reuse class the simulator passes (an engine storing a request's blocks when it ends
    can pass it too): the generated length in 25-token buckets (capped at 200+) and whether the
    request extended a cached prefix. ``None`` (no label) when the output length is unknown."""
    if output_tokens is None:
        return None
    return (min(max(output_tokens, 0) // 25, 8), extends_cached)
