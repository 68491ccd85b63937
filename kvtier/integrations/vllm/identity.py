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
from dataclasses import dataclass
from typing import Any

#: HF config keys that do not change what the model computes
_BOOKKEEPING = frozenset({"_name_or_path", "transformers_version", "_commit_hash", "name_or_path"})


@dataclass(frozen=True, slots=True)
class EngineIdentity:
    """One rank's identity (a value)."""

    model_id: str
    revision: str
    fingerprint: str
    engine_tag: str
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    def store_kwargs(self) -> dict[str, Any]:
        """Keywords for ``TieredStore(...)`` carrying this identity."""
        try:
            from kvtier.identity import Identity  # type: ignore[import-not-found,unused-ignore]
        except ImportError:  # before the store's identity API: fold it into the model id
            parts = (
                self.model_id,
                self.fingerprint,
                self.engine_tag,
                f"tp{self.tp_rank}/{self.tp_size}",
                f"pp{self.pp_rank}/{self.pp_size}",
            )
            return {"model_id": "|".join(parts), "weights_version": self.revision}
        return {
            "identity": Identity(
                model_id=self.model_id,
                revision=self.revision,
                tp_rank=self.tp_rank,
                tp_size=self.tp_size,
                pp_rank=self.pp_rank,
                pp_size=self.pp_size,
                engine_tag=self.engine_tag,
                model_fingerprint=self.fingerprint,
            )
        }


def model_fingerprint(vllm_config: Any) -> str:
    """A digest of everything in the model config that changes the KV it computes."""
    mc = vllm_config.model_config
    hf = mc.hf_config
    cfg = hf.to_dict() if hasattr(hf, "to_dict") else dict(vars(hf))
    desc = {
        "hf": {k: v for k, v in sorted(cfg.items()) if k not in _BOOKKEEPING},
        "dtype": str(mc.dtype),
        "quantization": str(getattr(mc, "quantization", None)),
        "max_model_len": None,  # does not change the bytes of a position's KV
    }
    text = json.dumps(desc, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def engine_identity(
    vllm_config: Any,
    engine_tag: str,
    model_id: str = "",
    tp: tuple[int, int] = (0, 1),
    pp: tuple[int, int] = (0, 1),
) -> EngineIdentity:
    """The identity of one rank; ``model_id`` ("" = vLLM's model name) from the kvtier config."""
    mc = vllm_config.model_config
    return EngineIdentity(
        model_id=model_id or str(mc.model),
        revision=str(mc.revision or ""),
        fingerprint=model_fingerprint(vllm_config),
        engine_tag=engine_tag,
        tp_rank=tp[0],
        tp_size=tp[1],
        pp_rank=pp[0],
        pp_size=pp[1],
    )
