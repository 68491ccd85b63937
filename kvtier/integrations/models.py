"""Causal LMs for kvtier's integration, tests, demo and benchmark -- never from a hub.

``random_model`` builds a Llama-, Qwen2-, Qwen3- or Mistral-architecture model from a config with
seeded random weights (the offline default); ``load_model`` loads a local checkpoint directory
(``--model PATH``) with ``local_files_only`` and ``HF_HUB_OFFLINE=1``, so nothing is downloaded at
run time. Both default to the length-invariant ``kvtier_exact`` attention (see
``kvtier.integrations.exact_attention``), which bit-identical prefix reuse needs on CPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtier.errors import ConfigError
from kvtier.integrations import exact_attention

ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")
ATTENTION = ("kvtier_exact", "sdpa", "eager")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Shape of a randomly initialised model. ``head_dim`` defaults to ``hidden // heads``."""

    arch: str = "llama"
    layers: int = 4
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    head_dim: int | None = None
    intermediate: int | None = None  # default 2 * hidden
    vocab: int = 1024
    max_positions: int = 32768
    seed: int = 0

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ConfigError(f"unknown architecture {self.arch!r}; choose one of {ARCHITECTURES}")
        if self.heads % self.kv_heads:
            raise ConfigError(
                f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})"
            )
        if self.head_dim is None and self.hidden % self.heads:
            raise ConfigError(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads})")


def _config(spec: ModelSpec) -> Any:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common: dict[str, Any] = {
        "vocab_size": spec.vocab,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate or 2 * spec.hidden,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "max_position_embeddings": spec.max_positions,
        "tie_word_embeddings": False,
    }
    if spec.head_dim is not None:
        common["head_dim"] = spec.head_dim
    if spec.arch == "llama":
        return LlamaConfig(**common)
    if spec.arch == "qwen2":
        return Qwen2Config(**common, use_sliding_window=False)
    if spec.arch == "qwen3":
        common.setdefault("head_dim", spec.hidden // spec.heads)
        return Qwen3Config(**common, use_sliding_window=False)
    return MistralConfig(**common, sliding_window=None)


def _attention(attn: str) -> str:
    if attn not in ATTENTION:
        raise ConfigError(f"unknown attention {attn!r}; choose one of {ATTENTION}")
    if attn == exact_attention.NAME:
        exact_attention.register()
    return attn


def _dtype(dtype: str) -> torch.dtype:
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ConfigError(f"unknown model dtype {dtype!r}; choose one of {list(_DTYPES)}") from None


def random_model(
    spec: ModelSpec | None = None,
    *,
    dtype: str = "float32",
    attn: str = exact_attention.NAME,
    device: str | torch.device = "cpu",
) -> Any:
    """A causal LM of ``spec``'s architecture with weights drawn from ``spec.seed``, in eval mode.

    The same spec and seed give the same weights on every run (CPU generator).
    """
    from transformers import AutoModelForCausalLM

    spec = spec or ModelSpec()
    cfg = _config(spec)
    cfg._attn_implementation = _attention(attn)
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(spec.seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=_dtype(dtype))  # type: ignore[no-untyped-call]
    finally:
        torch.random.set_rng_state(state)
    return model.to(device).eval()


def load_model(
    path: str | Path,
    *,
    dtype: str = "float32",
    attn: str = exact_attention.NAME,
    device: str | torch.device = "cpu",
) -> Any:
    """Load a causal LM from a local checkpoint directory; never contacts a hub. Raises
    ``ConfigError`` naming the directory when transformers cannot load it (a config.json without
    ``model_type``, an architecture it does not know, missing or unreadable weights)."""
    p = Path(path)
    if not (p / "config.json").is_file():
        raise ConfigError(f"{p} is not a checkpoint directory (no config.json); pass --model PATH")
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoModelForCausalLM

    torch_dtype, attn_name = _dtype(dtype), _attention(attn)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            p, local_files_only=True, dtype=torch_dtype, attn_implementation=attn_name
        )
    except (OSError, ValueError, KeyError) as exc:  # no model_type, unknown class, no weights
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"cannot load a causal LM from {p}: {first}") from None
    return model.to(device).eval()  # type: ignore[arg-type]


def load_tokenizer(path: str | Path) -> Any | None:
    """The checkpoint's tokenizer if it ships one (local files only), else None. A tokenizer
    that turns text into no ids (transformers builds an empty one for a checkpoint without
    vocabulary files) counts as none."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(Path(path), local_files_only=True)
    except (OSError, ValueError):
        return None
    return tok if tok.encode("Hello world", add_special_tokens=False) else None
