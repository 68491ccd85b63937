"""Moving whole vLLM blocks between the engine's KV cache and host staging buffers.

One gather and one scatter per layer, by block index (``index_select`` / ``index_copy_`` on the
``[num_blocks, *page]`` view of ``pages.PageLayout``), through an integer view of the same
bytes (bit-exact for every dtype, fp8 included). No per-token Python. The buffer a mover hands
out is ``[layers, n_blocks, *page_shape]`` on the host, ready for the store.

- ``PageMover``: the caches are host memory (vLLM's CPU backend); every copy is done when
  the call returns.
- ``CudaPageMover``: the caches are on a CUDA device. Staging buffers are pinned (torch's
  caching host allocator: reused, not re-pinned per call). Copies run on a side stream:
  ``start_gather`` enqueues the device->host copy after everything already on the forward's
  stream (so it reads what the forward wrote) and returns with an event; ``start_scatter``
  enqueues host->device copies after the forward's stream (so after vLLM zeroed new blocks)
  and records one event per layer, which the forward's stream waits on (``wait_layer`` /
  ``wait_all``: a device-side wait, the host does not block).

Not thread-safe: the model runner's thread calls every method except ``Gathered.wait``/
``ready`` (any thread).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.pages import PageLayout

#: the integer dtype carrying each element size (bit-exact moves, fp8 included)
_CARRIER = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _carrier(t: torch.Tensor) -> torch.Tensor:
    return t.view(_CARRIER[t.element_size()])


class Gathered(Protocol):
    """A gather in flight: ``buf`` holds the blocks once ``ready()``/``wait()`` says so."""

    @property
    def buf(self) -> torch.Tensor: ...

    def ready(self) -> bool: ...

    def wait(self) -> None: ...


class _Done:
    """A gather that completed before it was returned."""

    __slots__ = ("buf",)

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf

    def ready(self) -> bool:
        return True

    def wait(self) -> None:
        return None


class PageMover:
    """Moves whole vLLM blocks of host-memory caches (see the module docstring)."""

    def __init__(self, kv_caches: list[torch.Tensor], layout: PageLayout) -> None:
        self.layout = layout
        self._caches = kv_caches  # vLLM's tensors (kept for their lifetime)
        self._views = [_carrier(layout.blocks_view(c)) for c in kv_caches]

    def buffer(self, n_blocks: int) -> torch.Tensor:
        """A host staging buffer for ``n_blocks`` blocks of every layer (uninitialised)."""
        lay = self.layout
        return torch.empty((lay.layers, n_blocks, *lay.page_shape), dtype=lay.dtype)

    def as_kv(self, buf: torch.Tensor) -> torch.Tensor:
        """``buf`` viewed as a kvtier array ``[layers, 1, tokens, heads, per_head_token]``."""
        lay = self.layout
        tokens = buf.shape[1] * lay.page_tokens
        return buf.view(lay.layers, 1, tokens, lay.kv_heads, lay.per_head_token)

    def start_gather(self, block_ids: Sequence[int]) -> Gathered:
        """Copy blocks ``block_ids`` of every layer into a new buffer (vLLM's cache is read,
        not written)."""
        buf = self.buffer(len(block_ids))
        idx = torch.tensor(list(block_ids), dtype=torch.long)
        out = _carrier(buf)
        for layer, view in enumerate(self._views):
            torch.index_select(view, 0, idx, out=out[layer])
        return _Done(buf)

    def start_scatter(self, parts: Sequence[tuple[torch.Tensor, Sequence[int]]]) -> None:
        """For each ``(buf, block_ids)``: write ``buf[:, i]`` into block ``block_ids[i]`` of
        every layer (mutates vLLM's cache). ``buf`` is not read after the copies finished."""
        for buf, ids in parts:
            if not ids:
                continue
            idx = torch.tensor(list(ids), dtype=torch.long)
            src = _carrier(buf)
            for layer, view in enumerate(self._views):
                view.index_copy_(0, idx, src[layer, : len(ids)])

    def wait_layer(self, layer: int) -> None:
        """Make the forward wait for this step's loads into ``layer`` (host copies are done)."""
        return None

    def wait_all(self) -> None:
        """Make the forward wait for all of this step's loads."""
        return None


class _CudaGathered:
    __slots__ = ("_event", "buf")

    def __init__(self, buf: torch.Tensor, event: torch.cuda.Event) -> None:
        self.buf = buf
        self._event = event

    def ready(self) -> bool:
        return bool(self._event.query())  # type: ignore[no-untyped-call]

    def wait(self) -> None:
        self._event.synchronize()


class CudaPageMover(PageMover):
    """Moves whole vLLM blocks of CUDA caches through pinned buffers on a side stream."""

    def __init__(self, kv_caches: list[torch.Tensor], layout: PageLayout) -> None:
        super().__init__(kv_caches, layout)
        self.device = kv_caches[0].device
        self.stream = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
        self._layer_events: list[torch.cuda.Event | None] = [None] * layout.layers
        # host buffers of loads still being copied: kept alive until their events complete
        self._inflight: list[tuple[torch.cuda.Event, list[torch.Tensor]]] = []

    def buffer(self, n_blocks: int) -> torch.Tensor:
        lay = self.layout
        return torch.empty(
            (lay.layers, n_blocks, *lay.page_shape), dtype=lay.dtype, pin_memory=True
        )

    def _index(self, ids: Sequence[int]) -> torch.Tensor:
        """Block ids on the device, copied on the side stream (call inside its context)."""
        host = torch.tensor(list(ids), dtype=torch.long).pin_memory()
        return host.to(self.device, non_blocking=True)

    def start_gather(self, block_ids: Sequence[int]) -> Gathered:
        buf = self.buffer(len(block_ids))
        out = _carrier(buf)
        forward = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            self.stream.wait_stream(forward)  # read the blocks after the forward wrote them
            idx = self._index(block_ids)
            for layer, view in enumerate(self._views):
                part = torch.index_select(view, 0, idx)  # on the device, side stream
                out[layer].copy_(part, non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self.stream)
        return _CudaGathered(buf, event)

    def start_scatter(self, parts: Sequence[tuple[torch.Tensor, Sequence[int]]]) -> None:
        self._inflight = [(e, b) for e, b in self._inflight if not e.query()]  # type: ignore[no-untyped-call]
        work = [(_carrier(buf), ids) for buf, ids in parts if ids]
        if not work:
            return
        forward = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            self.stream.wait_stream(forward)  # after vLLM zeroed this step's new blocks
            idxs = [self._index(ids) for _, ids in work]
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            for layer, view in enumerate(self._views):  # layer-major: layer 0 lands first
                for (src, ids), idx in zip(work, idxs, strict=True):
                    part = src[layer, : len(ids)].to(self.device, non_blocking=True)
                    view.index_copy_(0, idx, part)
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(self.stream)
                self._layer_events[layer] = event
        self._inflight.append((event, [src for src, _ in work]))

    def wait_layer(self, layer: int) -> None:
        event = self._layer_events[layer]
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
            self._layer_events[layer] = None

    def wait_all(self) -> None:
        for layer in range(self.layout.layers):
            self.wait_layer(layer)


def make_mover(kv_caches: list[torch.Tensor], layout: PageLayout) -> PageMover:
    """The mover for the caches' device; ``ConfigError`` for a device kvtier cannot move."""
    device = kv_caches[0].device.type
    if device == "cpu":
        return PageMover(kv_caches, layout)
    if device == "cuda":
        return CudaPageMover(kv_caches, layout)
    raise ConfigError(
        f"kvtier's vLLM connector moves KV caches in host memory or on CUDA devices, not on "
        f"{device}; run without kv_connector=KvtierConnector"
    )
