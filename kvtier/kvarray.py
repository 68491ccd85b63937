"""Validation of KV arrays handed to the store: shape, dtype, memory, without copying.

A KV array is ``[layers, kv_factor, n_tokens, kv_heads, head_dim]``. numpy arrays must already be
in the layout's storage dtype (float32, float16; bf16 as uint16/int16; fp8 as uint8/int8); CPU
torch tensors are viewed as numpy (bf16/fp8 through an integer view of the same bytes, and an
integer tensor of that width is taken as the carrier, as for numpy), never copied. Anything else
raises ``LayoutError`` naming the mismatch.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvtier.errors import LayoutError
from kvtier.layout import KVLayout

Array = np.ndarray[Any, np.dtype[Any]]

_TORCH_INT_VIEW = {
    "float32": "int32",
    "float16": "int16",
    "bfloat16": "int16",
    "float8_e4m3fn": "uint8",
    "float8_e5m2": "uint8",
}


def _from_torch(t: Any, layout: KVLayout, what: str) -> Array:
    import torch

    if t.device.type != "cpu":
        raise LayoutError(
            f"{what} is on {t.device}; the store moves host memory -- copy it to the CPU first "
            "(the engine integrations do this with pinned buffers)"
        )
    name = str(t.dtype).removeprefix("torch.")
    want = layout.storage_dtype
    if name != layout.dtype:  # exact: the two fp8 variants are different bit layouts
        carrier = want.kind == "u" and not t.is_floating_point() and not t.is_complex()
        if carrier and t.dtype != torch.bool and t.element_size() == want.itemsize:
            as_np: Array = t.detach().numpy()  # an integer carrier, as numpy arrays may be
            return as_np.view(want)
        raise LayoutError(f"{what} has dtype {t.dtype}, the store's layout is {layout.dtype}")
    ints = t.detach().view(getattr(torch, _TORCH_INT_VIEW[layout.dtype]))
    arr: Array = ints.numpy()
    return arr.view(layout.storage_dtype)


def host_array(kv: Any, layout: KVLayout, what: str, writable: bool = False) -> Array:
    """A numpy view of ``kv`` in the layout's storage dtype; ``LayoutError`` if it does not fit."""
    if isinstance(kv, np.ndarray):
        arr: Array = kv
    elif hasattr(kv, "detach") and hasattr(kv, "device"):
        arr = _from_torch(kv, layout, what)
    else:
        raise LayoutError(f"{what} must be a numpy array or torch tensor, got {type(kv).__name__}")
    want = layout.storage_dtype
    if arr.dtype != want:
        int_carrier = want.kind == "u" and arr.dtype.kind in "iu"  # bf16 / fp8 carriers
        if not (int_carrier and arr.dtype.itemsize == want.itemsize):
            raise LayoutError(
                f"{what} has dtype {arr.dtype}; layout {layout.dtype} is carried as {want}"
            )
        arr = arr.view(want)
    if arr.ndim != 5:
        raise LayoutError(
            f"{what} must be 5-D [layers, kv_factor, tokens, kv_heads, head_dim], got shape "
            f"{arr.shape}"
        )
    expect = layout.kv_shape(arr.shape[2])
    if arr.shape != expect:
        raise LayoutError(f"{what} has shape {arr.shape}, layout expects {expect} (tokens free)")
    if writable and not arr.flags.writeable:
        raise LayoutError(f"{what} is read-only")
    return arr
