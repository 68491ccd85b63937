"""The few exceptions a caller must act on.

Expected outcomes (not present, no room, tier down, corrupt or foreign block) are *not*
exceptions: they are misses, ``False`` or ``None``. These are for mistakes the caller must fix.
"""

from __future__ import annotations


class KVTierError(Exception):
    """Base class of every kvtier exception."""


class ConfigError(KVTierError, ValueError):
    """A configuration value is unknown, malformed or impossible; the message says what to fix."""


class LayoutError(KVTierError, ValueError):
    """A KV array or buffer does not match the store's layout (shape, dtype, size)."""


class RequestError(KVTierError, TypeError):
    """A per-call argument other than the tokens and the KV (e.g. ``reuse_class``) has the wrong
    type; the message names it and says what to pass. Raised before anything is stored."""


class TokenError(KVTierError, ValueError):
    """Token ids are not a 1-D sequence of non-negative integers."""


class TierLockedError(KVTierError, RuntimeError):
    """A persistent tier's directory is already in use by another process."""
