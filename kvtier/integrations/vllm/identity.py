"""What names a vLLM engine's KV bytes: the kvtier identity derived from vLLM's config.

Every field that changes the bytes of a page is in the identity, so two engines share a block
only when they would have computed the same bytes:

- model id: ``[store] model_id``, else vLLM's ``model`` (path or hub name) -- the weights;
- revision: vLLM's ``revision`` -- another commit of the weights;
- fingerprint: the HF config (all of it but bookkeeping keys), vLLM's dtype and quantization --
  RoPE, attention and dtype settings;
- engine tag: the page format -- device, ISA (CPU pages are packed per instruction set), page
  shape, block size, dtype, cache dtype;
- TP/PP rank and size: vLLM's parallel state -- each rank holds other heads or layers;
- adapter and salt, per request: the LoRA adapter, ``cache_salt`` (``backend.Scope``, per call).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from kvtier.identity import Identity

#: HF config keys that do not change what the model computes
_BOOKKEEPING = frozenset({"_name_or_path", "transformers_version", "_commit_hash", "name_or_path"})


def model_fingerprint(vllm_config: Any) -> str:
    """A digest of everything in the model config that changes the KV it computes."""
    mc = vllm_config.model_config
    hf = mc.hf_config
    cfg = hf.to_dict() if hasattr(hf, "to_dict") else dict(vars(hf))
    desc = {
        "hf": {k: v for k, v in sorted(cfg.items()) if k not in _BOOKKEEPING},
        "dtype": str(mc.dtype),
        "quantization": str(getattr(mc, "quantization", None)),
    }
    text = json.dumps(desc, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def model_name(vllm_config: Any, model_id: str = "") -> tuple[str, str]:
    """(model id, revision): ``model_id`` from the kvtier config, else vLLM's model name."""
    mc = vllm_config.model_config
    return model_id or str(mc.model), str(mc.revision or "")


def engine_identity(
    vllm_config: Any,
    engine_tag: str,
    model_id: str = "",
    tp: tuple[int, int] = (0, 1),
    pp: tuple[int, int] = (0, 1),
) -> Identity:
    """The identity of one rank; ``model_id`` ("" = vLLM's model name) from the kvtier config.
    ``ConfigError`` (naming the field) for a value kvtier cannot key safely."""
    name, revision = model_name(vllm_config, model_id)
    return Identity(
        model_id=name,
        revision=revision,
        tp_rank=tp[0],
        tp_size=tp[1],
        pp_rank=pp[0],
        pp_size=pp[1],
        engine_tag=engine_tag,
        model_fingerprint=model_fingerprint(vllm_config),
    )
