"""Capacity planning arithmetic: how big the KV cache is, what fits in HBM, what spills where.

KV bytes per token = ``kv_factor x layers x kv_heads x head_dim x bytes_per_element``. It depends
on the attention shape, not on the parameter count: the formula ``params x 2 x 2 x context x
requests`` that some write-ups give is wrong -- for GPT-3 175B (96 layers, 96 heads, head_dim
128, fp16) the right figure is 4.5 MiB per token, 144 GiB for 32k tokens, while the
parameter-count formula claims ~20 PiB. ``Plan.wrong_formula_bytes`` reports it for contrast.

Tensor parallelism splits KV heads across GPUs; with more GPUs than KV heads every GPU still holds
one whole head, so heads are duplicated and the cluster-wide KV grows with ``tp``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kvtier.errors import ConfigError
from kvtier.layout import KVLayout

HBM_RESERVE_FRACTION = 0.10  # activations, CUDA graphs, fragmentation


@dataclass(frozen=True, slots=True)
class SpillTier:
    name: str
    capacity_bytes: int


@dataclass(frozen=True, slots=True)
class Plan:
    layout: KVLayout
    context_tokens: int
    requests: int
    tp: int
    gpu_memory_bytes: int
    weights_bytes: int
    kv_bytes_per_token: int
    kv_bytes_per_token_per_gpu: int
    kv_bytes_total: int
    hbm_bytes_total: int
    hbm_kv_budget_bytes: int
    hbm_kv_tokens: int
    requests_fit_in_hbm: int
    spill_bytes: int
    placement: dict[str, int] = field(default_factory=dict)
    unplaced_bytes: int = 0
    wrong_formula_bytes: int = 0
    params: int = 0
    #: the fewest GPUs (of this memory) whose HBM, less the reserve, holds the weights
    min_tp_for_weights: int = 1

    @property
    def weights_fit(self) -> bool:
        """The weights fit in the HBM left after the reserve (else there is no KV budget)."""
        return self.tp >= self.min_tp_for_weights

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["layout"] = asdict(self.layout)
        d["weights_fit"] = self.weights_fit
        d["fits_in_hbm"] = self.spill_bytes == 0 and self.weights_fit
        d["hbm_reserve_fraction"] = HBM_RESERVE_FRACTION
        return d


def make_plan(
    layout: KVLayout,
    *,
    context_tokens: int,
    requests: int = 1,
    tp: int = 1,
    gpu_memory_bytes: int = 80 * 10**9,
    weights_bytes: int = 0,
    params: int = 0,
    spill_tiers: list[SpillTier] | None = None,
) -> Plan:
    """Size the KV cache of ``requests`` concurrent sequences of ``context_tokens`` each."""
    if context_tokens < 0 or requests < 1 or tp < 1:
        raise ConfigError(
            "context tokens must be >= 0, requests >= 1 and tp >= 1 "
            f"(got {context_tokens}, {requests}, {tp})"
        )
    if gpu_memory_bytes <= 0:
        raise ConfigError(f"--gpu-memory must be positive, got {gpu_memory_bytes}")
    per_gpu = layout.with_tp(tp).bytes_per_token
    per_token = per_gpu * tp  # == the model's own figure unless heads are duplicated
    total = per_token * context_tokens * requests
    hbm = gpu_memory_bytes * tp
    usable_per_gpu = int(gpu_memory_bytes * (1 - HBM_RESERVE_FRACTION))
    budget = max(0, usable_per_gpu * tp - weights_bytes)
    hbm_tokens = budget // per_token if per_token else 0
    per_request = per_token * context_tokens
    fit_requests = budget // per_request if per_request else requests
    spill = max(0, total - budget)
    placement: dict[str, int] = {}
    left = spill
    for t in spill_tiers or []:
        take = min(left, t.capacity_bytes)
        placement[t.name] = take
        left -= take
    return Plan(
        layout=layout,
        context_tokens=context_tokens,
        requests=requests,
        tp=tp,
        gpu_memory_bytes=gpu_memory_bytes,
        weights_bytes=weights_bytes,
        kv_bytes_per_token=per_token,
        kv_bytes_per_token_per_gpu=per_gpu,
        kv_bytes_total=total,
        hbm_bytes_total=hbm,
        hbm_kv_budget_bytes=budget,
        hbm_kv_tokens=hbm_tokens,
        requests_fit_in_hbm=min(requests, fit_requests),
        spill_bytes=spill,
        placement=placement,
        unplaced_bytes=left,
        wrong_formula_bytes=params * 2 * 2 * context_tokens * requests,
        params=params,
        min_tp_for_weights=max(1, -(-weights_bytes // usable_per_gpu)) if usable_per_gpu else 1,
    )
