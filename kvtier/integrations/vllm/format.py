"""What a vLLM page's bytes mean, named as the engine tag of the identity.

Two pages share a kvtier block only if the same tokens and weights give them the same bytes,
so the tag names everything besides the model that decides those bytes: the device and, on
CPU, the instruction set (the CPU backend packs pages per ISA); the attention backend, the
page form, K/V placement and page shape (``pages.PageLayout.describe``); vLLM's block size;
the dtype and the KV cache dtype; for an fp8 cache with per-tensor scales, the scales.

KV cache dtypes (``check_cache_dtype``):

- ``auto``/``bfloat16``/``float16``: the model's values.
- ``fp8``/``fp8_e4m3``/``fp8_e5m2`` (per-tensor scales): a byte means ``value / scale``, with
  each layer's ``k_scale``/``v_scale``. vLLM 0.32 fixes them when the weights are loaded
  (from the checkpoint, else 1.0), before the KV cache exists; the connector reads them from
  the attention layers when the caches are registered and puts their digest in the tag, so a
  checkpoint with other scales never reads these blocks.
- ``fp8_per_token_head``: the scales are stored inside each page (the page is self-describing).
- anything else (NVFP4, int4/int8 per-token-head, TurboQuant, UltraQuant, MLA formats):
  refused with a ``ConfigError`` naming the dtype; their bytes depend on state kvtier does not
  key (block scales, rotations).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.pages import PageLayout

PLAIN_CACHE_DTYPES = frozenset({"auto", "bfloat16", "float16", "half", "float32"})
PER_TENSOR_FP8 = frozenset({"fp8", "fp8_e4m3", "fp8_e5m2"})
INLINE_SCALES = frozenset({"fp8_per_token_head"})


def check_cache_dtype(cache_dtype: str) -> str:
    """The scale mode of ``cache_dtype``: ``"none"``, ``"per-tensor"`` or ``"inline"``;
    ``ConfigError`` naming it when kvtier cannot key its bytes."""
    if cache_dtype in PLAIN_CACHE_DTYPES:
        return "none"
    if cache_dtype in PER_TENSOR_FP8:
        return "per-tensor"
    if cache_dtype in INLINE_SCALES:
        return "inline"
    supported = sorted(PLAIN_CACHE_DTYPES | PER_TENSOR_FP8 | INLINE_SCALES)
    raise ConfigError(
        f"kvtier's vLLM connector cannot key a kv_cache_dtype={cache_dtype!r} cache (its bytes "
        f"depend on state kvtier does not see); use one of {', '.join(supported)} or run "
        "without kv_connector=KvtierConnector"
    )


def scales_digest(scales: Sequence[tuple[Sequence[float], Sequence[float]]]) -> str:
    """A digest of every layer's ``(k_scales, v_scales)`` (per-tensor: one value each; a
    per-head checkpoint: one per head). ``ConfigError`` if one is not a positive finite number
    (vLLM has not fixed the scales yet: the bytes' meaning is unknown)."""
    if not scales:
        raise ConfigError("an fp8 KV cache without attention layers to read its scales from")
    h = hashlib.blake2b(digest_size=12)
    for layer, (k, v) in enumerate(scales):
        for name, values in (("k_scale", k), ("v_scale", v)):
            if not values or not all(math.isfinite(x) and x > 0 for x in values):
                raise ConfigError(
                    f"the fp8 KV cache's {name} of attention layer {layer} is {list(values)!r}, "
                    "not a positive number: kvtier cannot know what the cached bytes mean; use "
                    "a checkpoint with KV scales, kv_cache_dtype=auto, or run without "
                    "kv_connector=KvtierConnector"
                )
            h.update(f"{layer}|{name}|{','.join(repr(float(x)) for x in values)};".encode())
    return h.hexdigest()


def engine_tag(
    *,
    device: str,
    isa: str,
    pages: PageLayout,
    block_size: int,
    cache_dtype: str,
    scales: str = "-",
) -> str:
    """The engine tag: every setting besides the model that changes a page's bytes (see the
    module docstring). ``scales``: ``scales_digest`` for per-tensor fp8, else ``"-"``."""
    return (
        f"vllm-paged|{device}|isa={isa}|{pages.describe()}|block_size={block_size}"
        f"|dtype={pages.dtype}|cache_dtype={cache_dtype}|scales={scales}"
    )
