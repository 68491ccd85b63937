"""KV layout: the shape of one model's KV cache and of one kvtier block.

A block holds ``block_tokens`` tokens of *all* layers in one contiguous buffer, layer-major::

    [layers, kv_factor, block_tokens, kv_heads, head_dim]

so the slice of one layer (``kv_factor * block_tokens * kv_heads * head_dim`` elements) is
contiguous and can be streamed on its own.

KV bytes per token = ``kv_factor * layers * kv_heads * head_dim * bytes_per_element``.
``kv_factor`` is 2 for ordinary attention (K and V) and 1 for an MLA latent (DeepSeek-V3 stores
one ``kv_lora_rank + rope_dim`` = 512 + 64 vector per layer). It does not depend on the parameter
count.

Numpy has no bfloat16 or float8: those dtypes are carried in numpy as their *storage* type
(uint16, uint8) -- kvtier moves bytes, it never does arithmetic on KV.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from importlib import resources
from typing import Any

import numpy as np

from kvtier.errors import ConfigError, LayoutError

# name -> (bytes per element, numpy storage dtype)
_DTYPES: dict[str, tuple[int, str]] = {
    "float32": (4, "float32"),
    "float16": (2, "float16"),
    "bfloat16": (2, "uint16"),
    "float8_e4m3fn": (1, "uint8"),
    "float8_e5m2": (1, "uint8"),
}
_DTYPE_ALIASES = {
    "fp32": "float32",
    "float32": "float32",
    "f32": "float32",
    "fp16": "float16",
    "float16": "float16",
    "half": "float16",
    "f16": "float16",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    # fp8 without a variant means e4m3 (the usual KV-cache format); the two variants are
    # different bit layouts, so they are different dtypes (and different key namespaces).
    "fp8": "float8_e4m3fn",
    "float8": "float8_e4m3fn",
    "f8": "float8_e4m3fn",
    "float8_e4m3fn": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "e4m3": "float8_e4m3fn",
    "float8_e5m2": "float8_e5m2",
    "fp8_e5m2": "float8_e5m2",
    "e5m2": "float8_e5m2",
}
DEFAULT_BLOCK_TOKENS = 256


def canonical_dtype(name: str) -> str:
    """Map ``fp16``/``float16``/``bf16``/``fp8``... to kvtier's canonical dtype name."""
    key = str(name).lower().removeprefix("torch.")
    try:
        return _DTYPE_ALIASES[key]
    except KeyError:
        raise ConfigError(
            f"unknown dtype {name!r}: use one of fp32/float32, fp16/float16, bf16/bfloat16, "
            "fp8 (= float8_e4m3fn), float8_e5m2"
        ) from None


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Immutable description of a model's KV cache and of the block built from it."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "float16"
    kv_factor: int = 2
    block_tokens: int = DEFAULT_BLOCK_TOKENS

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        for name in ("layers", "kv_heads", "head_dim", "block_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise LayoutError(f"KVLayout.{name} must be a positive integer, got {value!r}")
        if self.kv_factor not in (1, 2):
            raise LayoutError(
                f"KVLayout.kv_factor must be 2 (K and V) or 1 (MLA latent), got {self.kv_factor!r}"
            )

    @property
    def bytes_per_element(self) -> int:
        return _DTYPES[self.dtype][0]

    @property
    def storage_dtype(self) -> np.dtype[Any]:
        """The numpy dtype that carries this layout's elements (bf16 -> uint16, fp8 -> uint8)."""
        return np.dtype(_DTYPES[self.dtype][1])

    @property
    def bytes_per_token(self) -> int:
        return self.kv_factor * self.layers * self.kv_heads * self.head_dim * self.bytes_per_element

    @property
    def block_bytes(self) -> int:
        return self.bytes_per_token * self.block_tokens

    @property
    def layer_block_bytes(self) -> int:
        """Bytes of one layer's contiguous slice of a block."""
        return self.block_bytes // self.layers

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.layers, self.kv_factor, self.block_tokens, self.kv_heads, self.head_dim)

    def kv_shape(self, n_tokens: int) -> tuple[int, int, int, int, int]:
        """Shape of a ``kv`` array of ``n_tokens`` tokens as passed to ``TieredStore.store``."""
        return (self.layers, self.kv_factor, n_tokens, self.kv_heads, self.head_dim)

    @property
    def fingerprint(self) -> bytes:
        """8 bytes identifying the block format; a block whose header differs is foreign."""
        desc = (
            f"kvtier-layout-v1|{self.layers}|{self.kv_factor}|{self.block_tokens}|"
            f"{self.kv_heads}|{self.head_dim}|{self.dtype}"
        )
        return hashlib.blake2b(desc.encode(), digest_size=8).digest()

    def toml_keys(self) -> str:
        """This layout as the ``[store]`` keys of a config (for messages that say what to set)."""
        return (
            f"layers = {self.layers}, kv_heads = {self.kv_heads}, head_dim = {self.head_dim}, "
            f'kv_factor = {self.kv_factor}, dtype = "{self.dtype}", '
            f"block_tokens = {self.block_tokens}"
        )

    def with_tp(self, tp: int) -> KVLayout:
        """The per-GPU layout under tensor parallelism ``tp``.

        Heads are split across ranks (rounded up to whole heads); when ``tp`` exceeds the KV
        head count each rank still holds one full head (heads are duplicated), so per-GPU KV
        never drops below one head.
        """
        if tp < 1:
            raise ConfigError(f"tensor parallel size must be >= 1, got {tp}")
        heads = -(-self.kv_heads // tp)  # ceil: a rank holds whole heads
        return KVLayout(
            self.layers, heads, self.head_dim, self.dtype, self.kv_factor, self.block_tokens
        )


@dataclass(frozen=True, slots=True)
class ModelPreset:
    """A published model shape shipped with kvtier (see ``presets/model_shapes.json``)."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    kv_factor: int
    attention: str
    params: int
    source: str

    def layout(self, dtype: str = "float16", block_tokens: int = DEFAULT_BLOCK_TOKENS) -> KVLayout:
        return KVLayout(
            self.layers, self.kv_heads, self.head_dim, dtype, self.kv_factor, block_tokens
        )


# Parameter counts (for weight memory in the planner) -- from each model's card.
_PARAMS = {
    "Llama-3.1-8B": 8_030_000_000,
    "Llama-3.1-70B": 70_600_000_000,
    "Llama-3.1-405B": 405_000_000_000,
    "Qwen2.5-7B": 7_610_000_000,
    "Qwen2.5-72B": 72_700_000_000,
    "Qwen3-235B-A22B": 235_000_000_000,
    "Mistral-7B-v0.1": 7_240_000_000,
    "Mixtral-8x7B": 46_700_000_000,
    "DeepSeek-V3": 671_000_000_000,
    "GPT-3-175B": 175_000_000_000,
}


def load_presets() -> dict[str, ModelPreset]:
    """All shipped model presets, by name."""
    text = resources.files("kvtier.presets").joinpath("model_shapes.json").read_text()
    out: dict[str, ModelPreset] = {}
    for m in json.loads(text):
        out[m["name"]] = ModelPreset(
            name=m["name"],
            layers=int(m["num_layers"]),
            kv_heads=int(m["num_kv_heads"]),
            head_dim=int(m["head_dim"]),
            kv_factor=int(m["kv_factor"]),
            attention=str(m.get("attention", "")),
            params=_PARAMS.get(m["name"], 0),
            source=str(m.get("source", "")),
        )
    return out


def preset(name: str) -> ModelPreset:
    """Look a preset up by name, case-insensitively; the error lists the valid names."""
    presets = load_presets()
    by_lower = {k.lower(): v for k, v in presets.items()}
    try:
        return by_lower[name.lower()]
    except KeyError:
        raise ConfigError(
            f"unknown model preset {name!r}; known: {', '.join(sorted(presets))}"
        ) from None
