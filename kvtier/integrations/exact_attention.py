"""A length-invariant attention kernel, so a cached prefix gives bit-identical outputs.

Why it exists (measured on CPU, fp32, torch 2.13 / MKL, transformers 5.24): with the stock
``sdpa`` and ``eager`` attention, the attention output of token ``i`` depends in its last bits on
how many *other* tokens were in the same forward pass. Eager's ``softmax(QK^T) @ V`` reduces over
the whole key length (masked keys contribute exact zeros, but the GEMM's blocking of that reduction
changes with its length); SDPA's flash kernel picks its key/query split sizes from the sequence
lengths. The KV of a prefix computed in an earlier, shorter request then differs by ~1 ulp from
the KV a single full forward computes, and logits differ by ~3e-7 -- not bit-identical.

``exact_attention`` removes that dependence: scores are computed per query chunk against all keys
(each score is one dot product over ``head_dim``, independent of the key count), the softmax
reduces lane-wise from key 0 (masked keys add exact zeros), and ``P @ V`` is summed over key
chunks of exactly ``KEY_CHUNK`` keys *aligned at absolute positions*, the last one zero-padded to
full size, accumulated in order. So every token's output is the same sequence of floating-point
operations whatever else is in the batch, and chunks entirely in a row's future are skipped (they
would add exact zeros). What remains is the GEMM kernel choice by row count: MKL computes rows of
a matrix with fewer than 12 rows by another kernel, so the integration always recomputes at least
``MIN_EXACT_ROWS`` tokens (see ``kvtier.integrations.hf``).

Contract: batch of 1 sequence without padding (the integration's case); the queries are the last
``q_len`` positions of the keys; attention is causal by position. A mask that would change that
is refused, never ignored: a 2-D padding mask with a zero (a left-padded prompt, or
``generate`` inferring one from a pad token in the prompt), a mask function other than the plain
causal one (packed sequences, custom overlays) or a 4-D mask that is not the causal one raises
``ConfigError`` (use ``sdpa``/``eager`` for padded batches).
Cost: like eager attention per query chunk, memory ``O(QUERY_CHUNK x keys)`` per head.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from kvtier.errors import ConfigError

NAME = "kvtier_exact"
KEY_CHUNK = 256
QUERY_CHUNK = 512
MIN_EXACT_ROWS = 16  # row counts below 12 use other MKL kernels; 16 leaves margin

_registered = False


def exact_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention, bitwise independent of the number of tokens in the pass.

    ``query`` [1, heads, q, d], ``key``/``value`` [1, kv_heads, k, d] (k >= q). Returns the output
    as [1, q, heads, d] (the layout transformers' attention functions return) and no weights.
    """
    b, heads, q_len, d = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    if b != 1:
        raise ValueError(f"{NAME} attention supports one sequence per call, got batch {b}")
    if attention_mask is not None:  # only a 4-D mask given to the model reaches us (see _mask)
        _check_causal(attention_mask, q_len, k_len)
    groups = heads // kv_heads
    scale = float(scaling) if scaling is not None else d**-0.5
    past = k_len - q_len
    n_chunks = -(-k_len // KEY_CHUNK)
    pad = n_chunks * KEY_CHUNK - k_len
    vpad = torch.nn.functional.pad(value, (0, 0, 0, pad)) if pad else value
    # GQA without copying K/V: the query heads of one KV head become extra rows.
    qg = query.reshape(b, kv_heads, groups, q_len, d)
    out = torch.empty(b, kv_heads, groups, q_len, d, dtype=query.dtype, device=query.device)
    for lo, hi in _query_chunks(q_len):
        rows = qg[:, :, :, lo:hi].reshape(b, kv_heads, groups * (hi - lo), d)
        first, last = past + lo, past + hi - 1  # absolute positions of the chunk's queries
        used = min(n_chunks, last // KEY_CHUNK + 1)  # key chunks not entirely in the future
        width = min(used * KEY_CHUNK, k_len)
        scores = torch.matmul(rows, key[:, :, :width].transpose(-1, -2)).mul_(scale)
        # only columns from the chunk's first query on can lie in some row's future
        qpos = torch.arange(first, last + 1, device=query.device).repeat(groups)
        cols = torch.arange(first, width, device=query.device)
        scores[..., first:].masked_fill_(cols.unsqueeze(0) > qpos.unsqueeze(1), -torch.inf)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        acc: torch.Tensor | None = None
        for j in range(used):
            k0 = j * KEY_CHUNK
            p = probs[..., k0 : k0 + KEY_CHUNK]
            if p.shape[-1] < KEY_CHUNK:  # the last chunk: zero-pad to the full chunk size
                p = torch.nn.functional.pad(p, (0, KEY_CHUNK - p.shape[-1]))
            part = torch.matmul(p, vpad[:, :, k0 : k0 + KEY_CHUNK])
            acc = part if acc is None else acc.add_(part)
        assert acc is not None
        out[:, :, :, lo:hi] = acc.reshape(b, kv_heads, groups, hi - lo, d)
    return out.reshape(b, heads, q_len, d).transpose(1, 2).contiguous(), None


def _query_chunks(q_len: int) -> list[tuple[int, int]]:
    """Split ``q_len`` rows into chunks of ``QUERY_CHUNK``; a short tail joins the previous chunk
    so that no chunk has fewer than ``MIN_EXACT_ROWS`` rows unless the whole pass does."""
    bounds = list(range(0, q_len, QUERY_CHUNK)) + [q_len]
    if len(bounds) > 2 and bounds[-1] - bounds[-2] < MIN_EXACT_ROWS:
        del bounds[-2]
    return list(itertools.pairwise(bounds))


def _refuse(what: str) -> ConfigError:
    return ConfigError(
        f"{NAME} attention runs one unpadded sequence, causal by position, but {what}; pass no "
        "attention_mask (or all ones), or build the model with attn='sdpa' for padded input"
    )


def _check_causal(mask: torch.Tensor, q_len: int, k_len: int) -> None:
    """Raise unless the 4-D ``mask`` ([1 or b, 1 or heads, q, k], bool or additive) lets each
    query see exactly the keys at or before its own position (what the kernel computes)."""
    if mask.dim() != 4 or mask.shape[-2:] != (q_len, k_len):
        shape = tuple(mask.shape)
        raise _refuse(f"got a {shape} attention mask for {q_len} queries x {k_len} keys")
    allowed = mask if mask.dtype == torch.bool else mask == 0
    rows = torch.arange(k_len - q_len, k_len, device=mask.device).unsqueeze(1)
    causal = torch.arange(k_len, device=mask.device).unsqueeze(0) <= rows
    if not bool((allowed == causal).all()):
        raise _refuse("the 4-D attention mask given is not the causal mask")


def _mask(
    *args: Any,
    mask_function: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> None:
    """Mask builder for ``NAME``: the kernel is causal by position and needs no mask tensor, so
    anything that would mask more than causality (padding, packing, overlays) is refused."""
    from transformers.masking_utils import causal_mask_function

    if mask_function is not None and mask_function is not causal_mask_function:
        name = getattr(mask_function, "__name__", type(mask_function).__name__)
        raise _refuse(f"the model asked for a mask other than causal ({name}: packing, overlays)")
    if attention_mask is not None and not bool(attention_mask.all()):
        masked = int((~attention_mask.bool()).sum())
        raise _refuse(f"attention_mask masks {masked} of {attention_mask.shape[-1]} positions")
    return None


def register() -> str:
    """Register the kernel with transformers (idempotent); return its attention name."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        AttentionInterface.register(NAME, exact_attention)
        AttentionMaskInterface.register(NAME, _mask)
        _registered = True
    return NAME
