"""Conversion between a transformers cache object and kvtier KV arrays, plus layout checks.

kvtier arrays are ``[layers, kv_factor, n_tokens, kv_heads, head_dim]`` (K at kv_factor 0, V at 1);
a transformers ``DynamicCache`` (5.x) holds one layer object per decoder layer whose ``keys`` and
``values`` are ``[batch, kv_heads, seq, head_dim]``. This module converts between the two for a
batch of one sequence, on CPU or CUDA (through pinned host buffers and non-blocking copies).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvtier.errors import ConfigError, LayoutError
from kvtier.identity import Identity
from kvtier.kvarray import Array
from kvtier.layout import KVLayout

_TORCH_DTYPES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
}
_INT_VIEW = {"float32": torch.int32, "float16": torch.int16, "bfloat16": torch.int16}


def model_device(model: Any) -> torch.device:
    """The device of the model's parameters."""
    return next(model.parameters()).device  # type: ignore[no-any-return]


def model_layout(model: Any, block_tokens: int) -> KVLayout:
    """The ``KVLayout`` of ``model``'s KV cache (layers, KV heads, head_dim, dtype).

    Raises ``LayoutError`` for models whose cache kvtier cannot hold exactly: sliding-window
    attention (the cache keeps only the window, so older blocks cannot be stored or reloaded)
    and dtypes other than fp32/fp16/bf16.
    """
    cfg = model.config.get_text_config(decoder=True)
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = getattr(cfg, "head_dim", None) or int(cfg.hidden_size) // heads
    window = getattr(cfg, "sliding_window", None)
    if window and getattr(cfg, "use_sliding_window", True):
        raise LayoutError(
            f"model uses sliding-window attention (window {window}); kvtier stores full-attention "
            "caches only -- load it with sliding_window=None (e.g. Mistral v0.2+ checkpoints)"
        )
    dtype = next(model.parameters()).dtype
    if dtype not in _TORCH_DTYPES:
        raise LayoutError(f"model dtype {dtype} is not supported; use float32, float16 or bfloat16")
    return KVLayout(
        int(cfg.num_hidden_layers), kv_heads, int(head_dim), _TORCH_DTYPES[dtype], 2, block_tokens
    )


#: config fields that change what K and V are for the same weights and tokens
_KV_CONFIG = (
    "model_type",
    "architectures",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "partial_rotary_factor",
    "max_position_embeddings",
    "attention_bias",
    "sliding_window",
    "use_sliding_window",
    "rms_norm_eps",
    "hidden_act",
    "vocab_size",
)


def model_fingerprint(model: Any) -> str:
    """A digest of everything in ``model``'s configuration that changes its KV for the same
    weights and tokens: architecture, shape, RoPE parameters, dtype, attention implementation.
    Two configurations that compute different KV get different fingerprints."""
    cfg = model.config.get_text_config(decoder=True)
    fields = {k: getattr(cfg, k, None) for k in _KV_CONFIG}
    fields["dtype"] = str(next(model.parameters()).dtype)
    fields["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
    text = json.dumps(fields, sort_keys=True, default=repr)
    return "hf:" + hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def model_identity(model: Any, model_id: str, revision: str = "") -> Identity:
    """The store ``Identity`` for ``model``: ``model_id``/``revision`` name its weights (the
    caller's: kvtier cannot tell two checkpoints of one architecture apart), the fingerprint of
    its configuration is derived here."""
    return Identity(model_id, revision, model_fingerprint=model_fingerprint(model))


def check_identity(model: Any, identity: Identity) -> None:
    """Raise ``ConfigError`` unless ``identity`` carries ``model``'s own fingerprint (a store
    built for another configuration, or without one, would share blocks across configs)."""
    want = model_fingerprint(model)
    if identity.model_fingerprint != want:
        got = identity.model_fingerprint or "none"
        raise ConfigError(
            f"the store's identity has model fingerprint {got}, this model's is {want}: build "
            "the store with identity=kvtier.integrations.hf_cache.model_identity(model, "
            "model_id, revision) so blocks of other model configurations are never served"
        )


def check_layout(model: Any, layout: KVLayout) -> None:
    """Raise ``LayoutError`` naming every field where ``model``'s cache differs from ``layout``."""
    want = model_layout(model, layout.block_tokens)
    if want == layout:
        return
    diffs = [
        f"{f}: model {getattr(want, f)} vs store {getattr(layout, f)}"
        for f in ("layers", "kv_heads", "head_dim", "dtype", "kv_factor")
        if getattr(want, f) != getattr(layout, f)
    ]
    raise LayoutError(
        "the store's KVLayout does not match the model's KV cache (" + "; ".join(diffs) + "); "
        "build the store with kvtier.integrations.hf_cache.model_layout(model, block_tokens)"
    )


def torch_dtype(layout: KVLayout) -> torch.dtype:
    """The torch dtype of ``layout``'s elements."""
    for t, name in _TORCH_DTYPES.items():
        if name == layout.dtype:
            return t
    raise LayoutError(f"layout dtype {layout.dtype} has no torch cache dtype")


def host_buffer(layout: KVLayout, n_tokens: int, pin: bool = False) -> tuple[torch.Tensor, Array]:
    """A host KV buffer for ``n_tokens``: the torch tensor and a numpy view of the same memory in
    the layout's storage dtype (what ``TieredStore.load``/``store`` take). ``pin`` page-locks it
    so CUDA copies from it can be non-blocking. Contents are uninitialised."""
    t = torch.empty(layout.kv_shape(n_tokens), dtype=torch_dtype(layout), pin_memory=pin)
    view: Array = t.view(_INT_VIEW[layout.dtype]).numpy().view(layout.storage_dtype)
    return t, view


def new_cache(model: Any) -> DynamicCache:
    """An empty cache of the model's own class for its config."""
    return DynamicCache(config=model.config)


def cache_from_kv(model: Any, kv: torch.Tensor, n_tokens: int) -> DynamicCache:
    """A cache holding the first ``n_tokens`` tokens of ``kv`` ([layers, 2, >=n, heads, dim]).

    The tensors are copied to the model's device (non-blocking from pinned memory); ``kv`` may be
    reused once the caller has synchronised the device.
    """
    cache = new_cache(model)
    if n_tokens == 0:
        return cache
    device = model_device(model)
    async_copy = device.type == "cuda" and kv.is_pinned()
    for i, layer in enumerate(_layers(cache)):
        # K and V of one layer are each contiguous in the host buffer: one plain (asynchronous
        # from pinned memory) copy each, then the [tokens, heads] -> [heads, tokens] transpose
        # happens on the device inside the cache's own concatenation.
        k = kv[i, 0, :n_tokens].to(device, non_blocking=async_copy)
        v = kv[i, 1, :n_tokens].to(device, non_blocking=async_copy)
        layer.update(k.permute(1, 0, 2).unsqueeze(0), v.permute(1, 0, 2).unsqueeze(0))
    return cache


class _StreamedLayer(DynamicLayer):  # type: ignore[no-untyped-call]
    """A full-attention cache layer whose first ``n`` tokens arrive from a layer-wise load.

    It reports the ``n`` tokens at once (positions and masks are computed before any layer
    runs) and fetches them with ``fill()`` -- which blocks until the load has this layer -- at
    its first ``update``, i.e. right before the model's attention of this layer uses the cache.
    The resulting tensors are the ones ``cache_from_kv`` builds.
    """

    def __init__(self, fill: Callable[[], tuple[torch.Tensor, torch.Tensor]], n: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._fill: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = fill
        self._n = n

    def get_seq_length(self) -> int:
        return self._n if self._fill is not None else int(super().get_seq_length())

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._fill is not None:
            k, v = self._fill()
            self._fill = None
            super().update(k, v)
        out: tuple[torch.Tensor, torch.Tensor] = super().update(
            key_states, value_states, *args, **kwargs
        )
        return out


def streamed_cache(
    model: Any, kv: torch.Tensor, n_tokens: int, wait: Callable[[int], None]
) -> DynamicCache:
    """Like ``cache_from_kv``, but layer ``i`` is taken from ``kv`` only when the model first
    uses it, after ``wait(i)`` returned (layer-wise loading: ``kv`` is still being filled)."""
    cache = new_cache(model)
    if n_tokens == 0:
        return cache
    device = model_device(model)
    async_copy = device.type == "cuda" and kv.is_pinned()

    def fill(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        wait(i)
        k = kv[i, 0, :n_tokens].to(device, non_blocking=async_copy)
        v = kv[i, 1, :n_tokens].to(device, non_blocking=async_copy)
        return k.permute(1, 0, 2).unsqueeze(0), v.permute(1, 0, 2).unsqueeze(0)

    for i, layer in enumerate(_layers(cache)):
        if type(layer) is not DynamicLayer:
            raise LayoutError(f"layer-wise loading needs full-attention layers, got {layer!r}")
        cache.layers[i] = _StreamedLayer(partial(fill, i), n_tokens)
    return cache


def _layers(cache: DynamicCache) -> list[Any]:
    """The cache's per-layer objects (full-attention layers with ``keys``/``values``)."""
    return list(cache.layers)


def cache_length(cache: DynamicCache) -> int:
    """Tokens held by the cache (its first layer)."""
    return int(cache.get_seq_length())


def kv_from_cache(
    cache: DynamicCache, start: int, end: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Tokens ``[start, end)`` of ``cache`` as a host tensor [layers, 2, end - start, heads, dim].

    Writes into ``out`` (a host tensor of that shape, pinned for non-blocking device copies) when
    given, else allocates one. Synchronises the device before returning, so the result is ready.
    Raises ``LayoutError`` if the cache holds fewer than ``end`` tokens.
    """
    held = cache_length(cache)
    if not 0 <= start <= end <= held:
        raise LayoutError(f"cache holds {held} tokens, cannot extract [{start}, {end})")
    layers = _layers(cache)
    first: torch.Tensor = layers[0].keys
    n_layers, heads, dim = len(layers), first.shape[1], first.shape[3]
    shape = (n_layers, 2, end - start, heads, dim)
    if out is None:
        out = torch.empty(shape, dtype=first.dtype, pin_memory=first.is_cuda)
    elif tuple(out.shape) != shape:
        raise LayoutError(f"out has shape {tuple(out.shape)}, expected {shape}")
    for i, layer in enumerate(layers):
        out[i, 0].copy_(layer.keys[0, :, start:end].permute(1, 0, 2), non_blocking=True)
        out[i, 1].copy_(layer.values[0, :, start:end].permute(1, 0, 2), non_blocking=True)
    if first.is_cuda:
        torch.cuda.synchronize(first.device)
    return out


def crop(cache: DynamicCache, n_tokens: int) -> None:
    """Drop every token from position ``n_tokens`` on (in place)."""
    held = cache_length(cache)
    if n_tokens < held:
        cache.crop(n_tokens - held)  # transformers 5: a negative count of tokens to drop


def as_numpy(kv: torch.Tensor, layout: KVLayout) -> Array:
    """A numpy view (no copy) of a CPU KV tensor in ``layout``'s storage dtype."""
    arr: Array = kv.view(_INT_VIEW[layout.dtype]).numpy().view(layout.storage_dtype)
    return np.ascontiguousarray(arr)
