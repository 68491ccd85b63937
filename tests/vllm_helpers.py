"""A tiny random-weight Llama model and vLLM engine builders for the vLLM connector tests."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

BLOCK_SIZE = 128
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def tiny_llama(
    path: Path, *, layers: int = 2, hidden: int = 256, seed: int = 0, vocab: int = 2048
) -> Path:
    """Save a seeded random-weight Llama model (no tokenizer) at ``path``; return ``path``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=16384,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    return path


def kv_transfer(kvtier_config: Any, **extra: Any) -> Any:
    from kvtier.integrations.vllm import transfer_config

    return transfer_config(kvtier_config, **extra)


def engine(
    model: Path,
    kvtier_config: Any = None,
    *,
    kv_bytes: int = 64 << 20,
    max_model_len: int = 16384,
    **kw: Any,
) -> Any:
    """A ``vllm.LLM`` on CPU over ``model``; with kvtier when ``kvtier_config`` is given."""
    from vllm import LLM

    if kvtier_config is not None:
        kw["kv_transfer_config"] = kv_transfer(kvtier_config)
    return LLM(
        model=str(model),
        skip_tokenizer_init=True,
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        kv_cache_memory_bytes=kv_bytes,
        max_model_len=max_model_len,
        dtype="bfloat16",
        seed=0,
        **kw,
    )


def greedy(n: int = 8, logprobs: int | None = None) -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, logprobs=logprobs, detokenize=False)


def prompt(tokens: list[int], salt: str | None = None) -> Any:
    p: dict[str, Any] = {"prompt_token_ids": tokens}
    if salt is not None:
        p["cache_salt"] = salt
    return p
