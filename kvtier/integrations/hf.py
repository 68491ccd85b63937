"""HuggingFace transformers integration: reuse cached prefixes in a causal LM's forward pass.

The only kvtier code (with ``hf_cache``, ``models`` and ``exact_attention`` beside it) that knows
transformers. For one sequence at a time (batch 1, no padding):

1. ``load_prefix``: ask the store for the longest cached prefix (``store.lookup``), load its KV
   with ``store.load`` into a host buffer (pinned for CUDA) and from there into the model's own
   cache object (``DynamicCache`` of the installed transformers version).
2. ``prefill``: run the forward pass only on the tokens after the reused prefix; positions follow
   from the cache length. Then store the prompt's new full blocks.
3. ``generate_with_cache``: greedy decoding after ``prefill``; the generated tokens' full blocks
   are stored afterwards, off the time-to-first-token path.

At least one token is always recomputed, because the logits of the last prompt token are what
generation needs and the cache holds KV, not logits. More precisely ``min_recompute`` tokens are
(default ``MIN_RECOMPUTE`` = 16): when the whole prompt is cached, the cache is cropped so that
the last 16 prompt tokens run again. The reason is bit-identity: MKL computes a matrix product
of fewer than 12 rows with different kernels than a long one, so recomputing only 1..11 tokens
gives logits that differ by ~1e-7 from a single full forward. The same holds for KV written by
decode steps (one row each): with ``store_generated="exact"`` (the default) the generated tokens
are run once more as one multi-row pass before their blocks are stored, so a later prompt that
contains this answer gets exactly the KV a full forward would compute. ``"decode"`` stores the
decode-step KV as is (no extra compute; later outputs may differ in the last bits), ``"none"``
stores only prompt blocks.

Bit-identity also needs the ``kvtier_exact`` attention (the default of
``kvtier.integrations.models``): with stock ``sdpa``/``eager`` a token's KV depends in its last
bits on the length of the pass that computed it. With those kernels everything works, the
outputs are merely not bit-identical (relative error ~1e-7).

A foreign, corrupt or lost block is a miss in the store; the forward pass then recomputes from
there, so the output is right whatever the store returns. The model's layout is checked against
the store's at every entry (``LayoutError`` on a mismatch) before anything is loaded.

``layerwise=True`` (off by default) streams the prefix layer by layer (``store.load_layers``)
while the forward runs: layer i's attention waits for layer i's KV; every block is verified
after the forward, and a failed one makes the forward run again from the verified prefix. On a
2-core CPU box it measured slower than whole-block loading (the loader thread takes the cores
the forward uses; ``kvtier bench ttft`` reports both), so it stays off unless a benchmark on the
target machine shows a gain.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Final, Literal

import numpy as np
import torch
from transformers import DynamicCache

from kvtier.errors import ConfigError, TokenError
from kvtier.integrations import hf_cache
from kvtier.keys import as_tokens
from kvtier.policy.hints import output_class

MIN_RECOMPUTE = 16
_OPTIONS = (
    "eos_token_id, store_generated, min_recompute, tenant, layerwise, reuse_class, "
    "attention_mask (all ones)"
)
StoreGenerated = Literal["exact", "decode", "none"]


class _ByOutput:
    def __repr__(self) -> str:
        return "BY_OUTPUT"


#: ``generate_with_cache(..., reuse_class=BY_OUTPUT)``: label the request by how it went
BY_OUTPUT: Final = _ByOutput()
Tokens = np.ndarray[Any, np.dtype[np.uint32]]


@dataclass(frozen=True, slots=True)
class PrefixLoad:
    """A cache filled from the store: ``n_reused`` tokens of KV in ``cache``."""

    cache: DynamicCache
    n_cached: int  # leading tokens the store held (multiple of block_tokens)
    n_reused: int  # tokens placed in the cache (<= n_cached, <= prompt - min_recompute)
    sources: tuple[str, ...]  # tier name of each loaded block, fastest first
    load_s: float
    # layer-wise: the load still streaming into ``cache`` (UNVERIFIED until ``stream.verify()``)
    # and the host buffer it fills; None for a whole-block (already verified) load
    stream: Any = None
    kv: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class Generation:
    """Result of ``generate_with_cache`` / ``generate_reference``."""

    tokens: list[int]  # generated token ids
    logits: torch.Tensor  # [len(tokens), vocab] logits that chose each token (on CPU)
    ttft_s: float  # call start -> logits of the first generated token
    n_cached: int = 0
    n_reused: int = 0
    sources: tuple[str, ...] = ()
    load_s: float = 0.0
    stored_tokens: int = 0  # tokens written to the store (prompt and generated blocks)


def input_tensor(model: Any, input_ids: Any) -> tuple[torch.Tensor, Tokens]:
    """``input_ids`` as a [1, T] int64 tensor on the model's device, and as store tokens.

    Accepts a 1-D sequence or a [1, T] tensor/array of integer ids on any device (converted).
    Raises ``TokenError`` for floats, several sequences, an empty prompt or ids outside the
    vocabulary (naming the position of the first bad id).
    """
    if isinstance(input_ids, torch.Tensor):
        if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
            raise TokenError(f"input_ids must be integer token ids, got dtype {input_ids.dtype}")
        if input_ids.dim() == 2 and input_ids.shape[0] != 1:
            raise TokenError(
                f"input_ids has a batch of {input_ids.shape[0]}; kvtier runs one sequence per call"
            )
        input_ids = input_ids.detach().cpu()
    try:
        tokens = as_tokens(input_ids)
    except TokenError as exc:
        raise _with_position(input_ids, exc) from None
    if len(tokens) == 0:
        raise TokenError("input_ids is empty; the prompt needs at least one token")
    vocab = int(model.config.get_text_config(decoder=True).vocab_size)
    if int(tokens.max()) >= vocab:
        at = int(np.argmax(tokens >= vocab))
        raise TokenError(
            f"token id {int(tokens[at])} at position {at} is outside the vocabulary ({vocab} ids)"
        )
    ids = torch.from_numpy(tokens.astype(np.int64)).unsqueeze(0)
    return ids.to(hf_cache.model_device(model)), tokens


def _with_position(input_ids: Any, exc: TokenError) -> TokenError:
    """``exc``, restated with the position of the first bad id when a value was out of range
    (``as_tokens`` checks shape and dtype first, so those errors are returned as they are)."""
    try:
        arr = np.asarray(input_ids)
    except (TypeError, ValueError):
        return exc
    arr = arr[0] if arr.ndim == 2 and arr.shape[0] == 1 else arr
    if arr.ndim != 1 or arr.dtype.kind not in "iu" or arr.size == 0:
        return exc
    for bad, rule in ((arr < 0, "non-negative"), (arr >= 2**32, "< 2**32")):
        if bad.any():
            at = int(np.argmax(bad))
            return TokenError(f"token ids must be {rule}, found {int(arr[at])} at position {at}")
    return exc


def load_prefix(
    model: Any,
    store: Any,
    input_ids: Any,
    *,
    min_recompute: int = MIN_RECOMPUTE,
    tenant: str | None = None,
    layerwise: bool = False,
) -> PrefixLoad:
    """Load the longest cached prefix of ``input_ids`` into a fresh cache of ``model``.

    Reuses at most ``len(input_ids) - min_recompute`` tokens (see the module docs). Does not run
    the model and does not modify the store's contents (the store may promote what it served).
    Raises ``LayoutError`` if the store's layout does not match the model.

    ``layerwise``: return at once with a cache whose layer ``i`` waits for its KV at the model's
    first use (``store.load_layers``), so loading overlaps the forward pass. The KV is then
    unverified: the caller MUST call ``result.stream.verify()`` after the forward (it also
    unpins) and redo the forward from the verified length if it is shorter than ``n_reused``
    -- ``generate_with_cache`` does. ``stream`` is None when the store served whole blocks.
    """
    if min_recompute < 1:
        raise ConfigError(f"min_recompute must be >= 1 (the last logits), got {min_recompute}")
    if layerwise and not hasattr(store, "load_layers"):
        raise ConfigError(
            "layerwise=True streams layers from an in-process store; this store (a kvtier "
            "service client) loads whole blocks: drop layerwise"
        )
    layout = store.layout
    hf_cache.check_layout(model, layout)
    hf_cache.check_identity(model, store.identity)
    _, tokens = input_tensor(model, input_ids)
    t0 = time.perf_counter()
    limit = max(0, len(tokens) - min_recompute)
    n_cached = store.lookup(tokens, tenant) if limit else 0
    want = min(n_cached, limit)
    if want == 0:
        return PrefixLoad(hf_cache.new_cache(model), n_cached, 0, (), time.perf_counter() - t0)
    bt = layout.block_tokens
    span = -(-want // bt) * bt  # whole blocks covering the tokens we reuse
    sources = tuple(store.locate(tokens[:span], tenant))
    pin = hf_cache.model_device(model).type == "cuda"
    buf, view = hf_cache.host_buffer(layout, span, pin=pin)
    if layerwise:
        stream = store.load_layers(tokens[:span], view, tenant)
        if stream.streamed:
            n_reused = min(stream.tokens, want)
            cache = hf_cache.streamed_cache(model, buf, n_reused, stream.wait)
            nb = -(-n_reused // bt)
            return PrefixLoad(
                cache, n_cached, n_reused, sources[:nb], time.perf_counter() - t0, stream, buf
            )
        got = stream.verify()
    else:
        got = store.load(tokens[:span], view, tenant)
    n_reused = min(got, want)  # a block lost or corrupt since lookup is a miss: reuse less
    cache = hf_cache.cache_from_kv(model, buf, n_reused)
    return PrefixLoad(
        cache, n_cached, n_reused, sources[: -(-n_reused // bt)], time.perf_counter() - t0
    )


def store_cache(
    store: Any,
    input_ids: Any,
    cache: DynamicCache,
    *,
    tenant: str | None = None,
    reuse_class: Hashable | None = None,
) -> int:
    """Store every full block of the tokens ``cache`` holds for ``input_ids``; return the tokens
    written (blocks already cached are skipped by the store). Never raises on I/O problems.
    ``reuse_class`` labels the request for the store's policy (a hint; ``TieredStore.store``)."""
    if isinstance(input_ids, torch.Tensor):
        input_ids = input_ids.detach().cpu()
    tokens = as_tokens(input_ids)
    bt = store.layout.block_tokens
    n = min(len(tokens), hf_cache.cache_length(cache)) // bt * bt
    if n == 0:
        return 0
    kv = hf_cache.kv_from_cache(cache, 0, n)
    kv_np = hf_cache.as_numpy(kv, store.layout)
    return int(store.store(tokens[:n], kv_np, tenant, reuse_class=reuse_class))


@torch.inference_mode()
def generate_with_cache(
    model: Any,
    store: Any,
    input_ids: Any,
    max_new_tokens: int,
    *,
    eos_token_id: int | list[int] | None = None,
    store_generated: StoreGenerated = "exact",
    min_recompute: int = MIN_RECOMPUTE,
    tenant: str | None = None,
    layerwise: bool = False,
    reuse_class: Hashable | None = None,
    attention_mask: Any = None,
    **options: object,
) -> Generation:
    """Greedy generation reusing the store's cached prefix of ``input_ids``.

    Greedy decoding of one unpadded sequence only: ``attention_mask`` may be given (a
    tokenizer's output) but must be all ones, ``do_sample`` may only be False; any other
    ``model.generate`` option (sampling, beams, temperature, ...) raises ``ConfigError`` naming
    it, rather than being ignored. ``eos_token_id``: one id or several; stops after the first.

    ``layerwise``: load the prefix layer by layer while the forward pass runs (see
    ``load_prefix``); the streamed KV is verified before anything is returned, and a block that
    fails makes the forward run again from the verified prefix (a miss), so the output is the
    same. ``load_s`` then covers only starting the load. ``reuse_class`` labels both stores for
    the store's policy (a hint; ``TieredStore.store``).

    Stores the prompt's new full blocks after the first token is produced, and the generated
    tokens' blocks at the end (``store_generated``, see the module docs). With
    ``reuse_class=BY_OUTPUT`` the prompt's blocks are stored at the end too, labelled
    ``output_class(generated tokens, reused a cached prefix)``: the class the simulator gives
    each trace request, which on the Mooncake trace tells a document that will be asked about
    again from one that will not (``docs/simulation.md``). Logits and tokens are
    bit-identical to ``generate_reference`` on CPU fp32 with ``kvtier_exact`` attention.
    """
    if store_generated not in ("exact", "decode", "none"):
        raise ConfigError(f"store_generated must be exact, decode or none, got {store_generated!r}")
    _check_new_tokens(max_new_tokens)
    _check_options(options)
    eos = _eos_ids(eos_token_id)
    t0 = time.perf_counter()
    ids, tokens = input_tensor(model, input_ids)
    _check_mask(attention_mask, len(tokens))
    pre = load_prefix(
        model, store, tokens, min_recompute=min_recompute, tenant=tenant, layerwise=layerwise
    )
    cache, n_reused = pre.cache, pre.n_reused
    try:
        out = model(
            ids[:, n_reused:], **hf_cache.cache_arg(model, cache), use_cache=True, logits_to_keep=1
        )
    finally:
        verified = pre.stream.verify() if pre.stream is not None else n_reused
    if verified < n_reused:  # streamed KV failed verification: recompute from the good prefix
        assert pre.kv is not None
        n_reused = verified
        cache = hf_cache.cache_from_kv(model, pre.kv, n_reused)
        out = model(
            ids[:, n_reused:], **hf_cache.cache_arg(model, cache), use_cache=True, logits_to_keep=1
        )
    first = out.logits[0, -1]
    _sync(first)
    ttft = time.perf_counter() - t0
    by_output = reuse_class is BY_OUTPUT
    if not by_output:
        stored = store_cache(store, tokens, cache, tenant=tenant, reuse_class=reuse_class)
    gen, logits = _decode(model, cache, first, max_new_tokens, eos)
    if by_output:  # the prompt's blocks are unchanged by decoding: store them now, labelled
        reuse_class = output_class(len(gen), n_reused > 0)
        stored = store_cache(store, tokens, cache, tenant=tenant, reuse_class=reuse_class)
    if store_generated != "none" and len(gen) > 1:
        seq = np.concatenate([tokens, np.asarray(gen[:-1], dtype=np.uint32)])
        if store_generated == "exact":
            bt = store.layout.block_tokens
            _recompute_tail(model, cache, seq, len(tokens), bt, min_recompute)
        stored += store_cache(store, seq, cache, tenant=tenant, reuse_class=reuse_class)
    sources = pre.sources[: -(-n_reused // store.layout.block_tokens)]
    return Generation(gen, logits, ttft, pre.n_cached, n_reused, sources, pre.load_s, stored)


@torch.inference_mode()
def generate_reference(
    model: Any, input_ids: Any, max_new_tokens: int, *, eos_token_id: int | list[int] | None = None
) -> Generation:
    """Plain greedy generation without kvtier: one forward over the whole prompt, then one
    decode step per token -- what ``model.generate(do_sample=False)`` computes."""
    _check_new_tokens(max_new_tokens)
    eos = _eos_ids(eos_token_id)
    t0 = time.perf_counter()
    ids, _ = input_tensor(model, input_ids)
    cache = hf_cache.new_cache(model)
    first = model(ids, **hf_cache.cache_arg(model, cache), use_cache=True, logits_to_keep=1).logits[
        0, -1
    ]
    _sync(first)
    ttft = time.perf_counter() - t0
    gen, logits = _decode(model, cache, first, max_new_tokens, eos)
    return Generation(gen, logits, ttft)


def _decode(
    model: Any, cache: DynamicCache, first: torch.Tensor, max_new: int, eos: frozenset[int]
) -> tuple[list[int], torch.Tensor]:
    logits = [first]
    gen = [int(first.argmax())]
    while len(gen) < max_new and gen[-1] not in eos:
        step = torch.tensor([[gen[-1]]], device=first.device)
        nxt = model(
            step, **hf_cache.cache_arg(model, cache), use_cache=True, logits_to_keep=1
        ).logits[0, -1]
        logits.append(nxt)
        gen.append(int(nxt.argmax()))
    return gen, torch.stack(logits).cpu()


def _check_new_tokens(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 1:
        raise ConfigError(f"max_new_tokens must be a positive integer, got {n!r}")


def _check_options(options: dict[str, object]) -> None:
    """Refuse ``model.generate`` options that greedy decoding would silently ignore."""
    if options.get("do_sample") is False:
        options = {k: v for k, v in options.items() if k != "do_sample"}
    if options:
        got = ", ".join(f"{k}={v!r}" for k, v in options.items())
        raise ConfigError(
            f"generate_with_cache decodes greedily, one unpadded sequence; unsupported: {got} "
            f"(it takes max_new_tokens, {_OPTIONS}; use model.generate for sampling or beams)"
        )


def _check_mask(mask: Any, n_tokens: int) -> None:
    """Accept no mask or an all-ones one of the prompt's length; a zero would mean padding."""
    if mask is None:
        return
    m = np.asarray(mask.detach().cpu() if isinstance(mask, torch.Tensor) else mask)
    if m.size != n_tokens or (m.ndim == 2 and m.shape[0] != 1) or m.ndim not in (1, 2):
        raise ConfigError(
            f"attention_mask has shape {m.shape}; expected one row of {n_tokens} (the prompt's)"
        )
    if not bool((m == 1).all()):
        raise ConfigError(
            f"attention_mask masks {int((m != 1).sum())} of {n_tokens} positions; "
            "generate_with_cache runs one unpadded sequence: strip the padding from input_ids"
        )


def _eos_ids(eos: object) -> frozenset[int]:
    """``eos_token_id`` (one id, a list of ids, or None) as a set; raise ``ConfigError`` else."""
    ids = [] if eos is None else [eos] if isinstance(eos, int | np.integer) else eos
    if not isinstance(ids, list | tuple | set | frozenset) or any(
        isinstance(i, bool) or not isinstance(i, int | np.integer) for i in ids
    ):
        raise ConfigError(f"eos_token_id must be a token id or a list of ids, got {eos!r}")
    return frozenset(int(i) for i in ids)


def _recompute_tail(
    model: Any, cache: DynamicCache, seq: Tokens, n_prompt: int, bt: int, min_rows: int
) -> None:
    """Re-run the generated part of ``seq`` as one multi-row pass so its KV is what a full
    forward computes (decode steps compute one row at a time, with other kernels)."""
    end = len(seq) // bt * bt
    start = n_prompt // bt * bt
    if end <= start:
        return
    start = max(0, min(start, len(seq) - min_rows))
    hf_cache.crop(cache, start)
    ids = torch.from_numpy(seq[start:].astype(np.int64)).unsqueeze(0)
    model(
        ids.to(hf_cache.model_device(model)),
        **hf_cache.cache_arg(model, cache),
        use_cache=True,
        logits_to_keep=1,
    )


def _sync(t: torch.Tensor) -> None:
    if t.is_cuda:
        torch.cuda.synchronize(t.device)
