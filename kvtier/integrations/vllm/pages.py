"""The shape of vLLM's paged KV cache, as kvtier reads it: which dimension indexes pages.

vLLM hands the connector one tensor per attention layer. kvtier never looks inside a page: a
kvtier block that is exactly ``k`` whole vLLM blocks is stored as those blocks' bytes, so all
it needs is a view of each layer as ``[num_blocks, *page]`` (a vLLM block first, whatever the
tensor's order) and the page's shape. Two forms are known:

- ``BHNC`` (vLLM 0.32, every backend): the logical per-layer view ``[num_blocks * r, kv_heads,
  block_size / r, content]`` (``r`` kernel blocks per vLLM block when the attention kernel uses
  smaller blocks). The physical memory order varies (``VLLM_KV_CACHE_LAYOUT``: ``LBHNC``,
  ``LBNHC``, ``LHBNC``, block-outermost ``BLHNC``...) but kvtier indexes the logical view, so
  the gathered bytes are the same for every physical order. K and V are both in ``content``
  (``[K | V]`` at ``head_size`` on the GPU backends; per head, ``block_size`` rows of K then of
  V in the CPU backend's ISA packing).
- ``2BNHD`` (older vLLM GPU backends): ``[2, num_blocks, block_size, kv_heads, head_size]``, K
  and V apart on dimension 0 and pages on dimension 1.

``page_layout`` recognises the form from the tensors, the attention backend's name and the
model's head geometry, and refuses anything else with a ``ConfigError`` naming the backend.
The staging buffer of ``n`` vLLM blocks is ``[layers, n, *page_shape]`` (contiguous); viewed as
the kvtier array ``[layers, 1, n * block_size, kv_heads, per_token]`` it puts kvtier block ``j``
on vLLM blocks ``[j*k, (j+1)*k)`` of every layer. The bytes' meaning (backend, ISA, dtype,
scales) is named by the engine tag (``format``), so blocks never meet another format.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvtier.errors import ConfigError
from kvtier.layout import KVLayout, canonical_dtype

#: attention backends whose pages kvtier can move, and how K and V sit in one page
KV_SPLIT: dict[str, str] = {
    "CPU_ATTN": "head-rows",  # per head: block_size rows of K, then of V (ISA-packed)
    "FLASH_ATTN": "content",  # content = [K(head_size) | V(head_size)]
    "FLASHINFER": "content",
    "TRITON_ATTN": "content",  # fp8_per_token_head: [K | K scale | V | V scale]
}
#: backends that used the K/V-major 5-D form before vLLM 0.32
_KV_MAJOR = frozenset({"FLASH_ATTN", "FLASHINFER", "TRITON_ATTN"})


@dataclass(frozen=True, slots=True)
class PageLayout:
    """How one vLLM block of every layer is read (a value; see the module docstring)."""

    backend: str
    form: str  # "BHNC" or "2BNHD"
    kv_split: str  # where K and V are apart inside a page (named in the engine tag)
    layers: int
    page_shape: tuple[
        int, ...
    ]  # one vLLM block as gathered: BHNC [r, H, N/r, C]; 2BNHD [2, N, H, D]
    page_tokens: int  # vLLM's block_size
    kv_heads: int
    dtype: torch.dtype  # the tensors' (vLLM's CPU backend keeps fp8 in uint8 tensors)
    store_dtype: str  # kvtier's name for the elements (the bytes are opaque to kvtier)

    def __post_init__(self) -> None:
        if math.prod(self.page_shape) % (self.page_tokens * self.kv_heads):
            raise ConfigError(f"a page {self.page_shape} is not whole tokens of whole heads")

    @property
    def page_dim(self) -> int:
        """The dimension of vLLM's per-layer tensor that indexes pages."""
        return 1 if self.form == "2BNHD" else 0

    @property
    def per_head_token(self) -> int:
        """Elements per (token, head) of a page (2 * head_dim for K+V)."""
        return math.prod(self.page_shape) // (self.page_tokens * self.kv_heads)

    @property
    def page_bytes(self) -> int:
        """Bytes of one vLLM block of one layer."""
        return math.prod(self.page_shape) * self.dtype.itemsize

    def kvtier_layout(self, block_tokens: int) -> KVLayout:
        return KVLayout(
            layers=self.layers,
            kv_heads=self.kv_heads,
            head_dim=self.per_head_token,
            dtype=self.store_dtype,
            kv_factor=1,
            block_tokens=block_tokens,
        )

    def describe(self) -> str:
        """The part of the engine tag this layout decides."""
        shape = "x".join(str(d) for d in self.page_shape)
        return f"backend={self.backend}|form={self.form}|kv={self.kv_split}|page={shape}"

    def blocks_view(self, cache: torch.Tensor) -> torch.Tensor:
        """``cache`` (one layer, as vLLM registered it) viewed as ``[num_blocks, *page_shape]``
        (a view: no copy, strides kept)."""
        if self.form == "2BNHD":
            return cache.movedim(1, 0)
        return cache.view(-1, *self.page_shape)


def element_dtype(dtype: torch.dtype, cache_dtype: str) -> str:
    """kvtier's dtype name for cache elements of torch ``dtype`` under vLLM's
    ``kv_cache_dtype`` (fp8 in byte tensors: the variant ``cache_dtype`` names);
    ``ConfigError`` for elements kvtier has no name for."""
    if dtype.is_floating_point:
        return canonical_dtype(str(dtype))
    if dtype.itemsize == 1 and cache_dtype.startswith("fp8"):
        return canonical_dtype("fp8_e5m2" if "e5m2" in cache_dtype else "fp8")
    raise ConfigError(
        f"kvtier cannot name KV cache elements of {dtype} with kv_cache_dtype={cache_dtype!r}; "
        "use a floating-point or fp8 KV cache"
    )


def page_layout(
    kv_caches: list[torch.Tensor],
    *,
    backend: str,
    block_size: int,
    kv_heads: int,
    head_size: int,
    cache_dtype: str = "auto",
) -> PageLayout:
    """The layout of vLLM's per-layer caches; ``ConfigError`` (naming the backend and what to
    change) for a backend or a shape kvtier does not know, or layers that differ.
    ``cache_dtype`` (vLLM's ``kv_cache_dtype``) names the fp8 variant of byte tensors."""
    if not kv_caches:
        raise ConfigError("vLLM registered no KV cache layers; kvtier has nothing to store")
    if backend not in KV_SPLIT:
        raise ConfigError(
            f"kvtier's vLLM connector does not support the {backend} attention backend; use one "
            f"of {', '.join(sorted(KV_SPLIT))} (VLLM_ATTENTION_BACKEND / attention_backend) or "
            "run without kv_connector=KvtierConnector"
        )
    first = kv_caches[0]
    for t in kv_caches:
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
            raise ConfigError(
                "kvtier's vLLM connector needs every attention layer's cache in one shape "
                f"(hybrid or mixed-attention models are not supported): {tuple(t.shape)} "
                f"{t.dtype} vs {tuple(first.shape)} {first.dtype}"
            )
    shape = tuple(first.shape)
    layers, dtype = len(kv_caches), first.dtype
    store = element_dtype(dtype, cache_dtype)
    if len(shape) == 4 and shape[1] == kv_heads and shape[2] and block_size % shape[2] == 0:
        r = block_size // shape[2]
        if shape[0] % r == 0 and shape[3] % 2 == 0 and shape[3] >= 2 * head_size:
            page = (r, kv_heads, shape[2], shape[3])
            split = KV_SPLIT[backend]
            return PageLayout(
                backend, "BHNC", split, layers, page, block_size, kv_heads, dtype, store
            )
    if (
        len(shape) == 5
        and backend in _KV_MAJOR
        and shape[0] == 2
        and shape[2:] == (block_size, kv_heads, head_size)
    ):
        page = (2, block_size, kv_heads, head_size)
        return PageLayout(
            backend, "2BNHD", "dim0", layers, page, block_size, kv_heads, dtype, store
        )
    raise ConfigError(
        f"kvtier cannot read the {backend} KV cache layout {shape} {dtype}: it reads "
        f"[num_blocks, kv_heads={kv_heads}, block_size={block_size} (or a divisor), "
        f"2*head_size={2 * head_size}...] (vLLM 0.32) or [2, num_blocks, {block_size}, "
        f"{kv_heads}, {head_size}]; run this model without kv_connector=KvtierConnector"
    )
