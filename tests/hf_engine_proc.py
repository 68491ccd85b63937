"""An HF transformers engine process for the service tests: ``hf_engine_proc.py CONFIG TOKENS``.

Opens its store from the kvtier config (``hf_store.open_model_store``: a ``[service] url`` makes
it a client of that service), generates from a fixed prompt over a tiny random Llama on CPU
and prints ``hf N_REUSED SAME`` (``SAME``: tokens and logits identical to a plain run).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(config: str, n: int) -> int:
    import torch

    from kvtier.integrations import hf
    from kvtier.integrations.hf_store import open_model_store
    from kvtier.integrations.models import ModelSpec, random_model

    model = random_model(ModelSpec(arch="llama", seed=1))
    ids = np.random.default_rng(4).integers(0, 1024, n).astype(np.int64)
    with open_model_store(model, config, name="test-hf-proc") as store:
        got = hf.generate_with_cache(model, store, ids, 6)
    ref = hf.generate_reference(model, ids, 6)
    same = got.tokens == ref.tokens and bool(torch.equal(got.logits, ref.logits))
    print(f"hf {got.n_reused} {same}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
