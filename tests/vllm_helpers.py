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


def tiny_lora(path: Path, base: Path, *, seed: int, rank: int = 8) -> Path:
    """A random LoRA adapter for ``tiny_llama(base)`` in PEFT format (q/v projections) at
    ``path``; return ``path``."""
    import json

    import torch
    from safetensors.torch import save_file

    cfg = json.loads((base / "config.json").read_text())
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    out = {
        "q_proj": cfg["num_attention_heads"] * head_dim,
        "v_proj": cfg["num_key_value_heads"] * head_dim,
    }
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for i in range(layers):
        for proj, n_out in out.items():
            key = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            weights[f"{key}.lora_A.weight"] = torch.randn(rank, hidden, generator=g) * 0.1
            weights[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * 0.1
    path.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.to(torch.bfloat16).contiguous() for k, v in weights.items()},
        str(path / "adapter_model.safetensors"),
    )
    (path / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
                "target_modules": sorted(out), "lora_dropout": 0.0, "bias": "none",
                "fan_in_fan_out": False, "base_model_name_or_path": str(base),
                "modules_to_save": None, "use_rslora": False, "use_dora": False,
            }
        )
    )  # fmt: skip
    return path
