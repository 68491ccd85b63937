"""vLLM's paged KV cache <-> kvtier blocks: one gather and one scatter per layer, by page index.

vLLM keeps one tensor per attention layer whose leading dimension indexes pages (the CPU
backend: ``[num_pages, kv_heads, block_size, 2 * head_dim]``, packed per instruction set). kvtier
never looks inside a block and slices only at block boundaries, so a kvtier block that is
exactly ``k`` whole pages is stored as those pages' bytes: the gathered ``[layers, k * m,
*page]`` buffer (``m`` kvtier blocks) viewed as the kvtier array ``[layers, 1, k * m *
block_size, kv_heads, per_token]`` puts kvtier block ``j`` on pages ``[j*k, (j+1)*k)`` of every
layer. The bytes are opaque (K and V as vLLM packs them); the engine tag in the identity names
that packing so such blocks never meet another layout.

One copy each way: ``torch.index_select(..., out=buffer[layer])`` on the way out,
``index_copy_`` on the way in; no per-token Python.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.errors import ConfigError
from kvtier.layout import KVLayout, canonical_dtype


@dataclass(frozen=True, slots=True)
class PageLayout:
    """The shape of one vLLM page and the kvtier layout of whole pages (a value)."""

    layers: int
    page_shape: tuple[int, ...]  # one page: [kv_heads, block_size, per_token_elements / heads]
    page_tokens: int
    dtype: torch.dtype

    @property
    def kv_heads(self) -> int:
        return self.page_shape[0]

    @property
    def per_head_token(self) -> int:
        """Elements per (token, head) of a page: 2 * head_dim for a K+V page."""
        n = 1
        for d in self.page_shape:
            n *= d
        return n // (self.page_tokens * self.kv_heads)

    def kvtier_layout(self, block_tokens: int) -> KVLayout:
        return KVLayout(
            layers=self.layers,
            kv_heads=self.kv_heads,
            head_dim=self.per_head_token,
            dtype=canonical_dtype(str(self.dtype)),
            kv_factor=1,
            block_tokens=block_tokens,
        )


def page_layout(kv_caches: list[torch.Tensor], page_tokens: int) -> PageLayout:
    """The page layout of vLLM's per-layer caches (``ConfigError`` for one kvtier cannot store:
    layers of different shapes, a page that is not ``[heads, block_size, ...]``)."""
    if not kv_caches:
        raise ConfigError("vLLM registered no KV cache layers; kvtier has nothing to store")
    first = kv_caches[0]
    for t in kv_caches:
        if t.shape[1:] != first.shape[1:] or t.dtype != first.dtype:
            raise ConfigError(
                "kvtier's vLLM connector needs every attention layer's cache in one shape "
                f"(hybrid or mixed-attention models are not supported): {tuple(t.shape)} vs "
                f"{tuple(first.shape)}"
            )
    if first.dim() != 4 or first.shape[2] != page_tokens:
        raise ConfigError(
            f"unsupported vLLM KV cache layout {tuple(first.shape)}: kvtier's connector reads "
            f"pages [num_blocks, kv_heads, block_size={page_tokens}, ...] (the CPU backend)"
        )
    return PageLayout(len(kv_caches), tuple(first.shape[1:]), page_tokens, first.dtype)


class PageMover:
    """Moves whole pages between vLLM's caches and a staging buffer. Not thread-safe: called
    on the model runner's thread only."""

    def __init__(self, kv_caches: list[torch.Tensor], layout: PageLayout) -> None:
        self._caches = kv_caches
        self.layout = layout

    def buffer(self, n_pages: int) -> torch.Tensor:
        """A staging buffer for ``n_pages`` pages of every layer (uninitialised)."""
        return torch.empty(
            (self.layout.layers, n_pages, *self.layout.page_shape), dtype=self.layout.dtype
        )

    def as_kv(self, buf: torch.Tensor) -> torch.Tensor:
        """``buf`` viewed as a kvtier array ``[layers, 1, tokens, heads, per_head_token]``."""
        lay = self.layout
        tokens = buf.shape[1] * lay.page_tokens
        return buf.view(lay.layers, 1, tokens, lay.kv_heads, lay.per_head_token)

    def gather(self, page_ids: list[int]) -> torch.Tensor:
        """Copy pages ``page_ids`` of every layer into a new buffer (does not mutate vLLM's)."""
        idx = torch.tensor(page_ids, dtype=torch.long)
        buf = self.buffer(len(page_ids))
        for layer, cache in enumerate(self._caches):
            torch.index_select(cache, 0, idx, out=buf[layer])
        return buf

    def scatter(self, buf: torch.Tensor, page_ids: list[int]) -> None:
        """Write ``buf[:, i]`` into page ``page_ids[i]`` of every layer (mutates vLLM's cache)."""
        if not page_ids:
            return
        idx = torch.tensor(page_ids, dtype=torch.long)
        part = buf[:, : len(page_ids)]
        for layer, cache in enumerate(self._caches):
            cache.index_copy_(0, idx, part[layer])
