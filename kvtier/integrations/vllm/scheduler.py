"""The connector's scheduler side: what kvtier can serve, and which pages to load and save.

Runs in vLLM's engine-core process, on the scheduler's one thread (not thread-safe). It holds
no store: lookups go to the ranks' stores (``lookup_rpc``), and every transfer is a ``PageOp``
in the step's metadata, done by the worker side.

- ``matched``: the tokens kvtier can add beyond vLLM's own hit. Side-effect free on the
  cache; on a miss it costs one first-block question (no work proportional to the prompt).
  It never promises the last prompt token (vLLM must compute at least one) and answers 0 when
  any rank cannot answer in time. A promised block that turns out missing at load time is
  reported by the worker as a load error, and vLLM (``kv_load_failure_policy = "recompute"``)
  recomputes it.
- saves: after each step, the full kvtier blocks of tokens whose KV the step computed and
  that kvtier does not hold yet (from the end of the looked-up prefix onward).
- async saves (``async_save``): a finished request that had saves keeps its pages until the
  workers report its copies done (``finished`` returns True: vLLM's delayed free), and each
  step's metadata names the requests vLLM preempted, whose copies the workers finish before
  the forward reuses their pages.
- requests kvtier cannot key safely (multimodal inputs, prompt embeddings) are neither looked up
  nor saved; ``uncacheable`` counts them, and their output says so (``kv_transfer_params``
  ``{"kvtier": "uncacheable"}``, returned by ``finished``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.integrations.vllm.backend import Scope
from kvtier.integrations.vllm.metadata import KvtierMetadata, PageOp

LookupFn = Callable[[np.ndarray[Any, Any], Scope, int], int]
LeaseFn = Callable[[str, np.ndarray[Any, Any], Scope, int], int]


@dataclass(slots=True)
class _Req:
    request: Any
    scope: Scope
    local: int = 0  # vLLM's own hit when last looked up
    held: int = 0  # kvtier's prefix end: saves start here
    load_end: int = 0  # > local: a load is owed for [local, load_end)
    pending_load: bool = False
    saved: bool = False  # a save was issued (async: vLLM must wait for the workers to free)


def request_scope(request: Any) -> Scope:
    """The request's adapter and salt ("" = none)."""
    lora = getattr(request, "lora_request", None)
    adapter = ""
    if lora is not None:
        adapter = f"{lora.lora_name}|{getattr(lora, 'lora_path', '')}|{lora.lora_int_id}"
    return Scope(adapter, str(getattr(request, "cache_salt", None) or ""))


def cacheable(request: Any) -> bool:
    """False for inputs the token ids do not name (multimodal features, prompt embeddings)."""
    return (
        not getattr(request, "mm_features", None)
        and getattr(request, "prompt_embeds", None) is None
    )


class SchedulerSide:
    """Per-request bookkeeping between vLLM's scheduler hooks (see the module docstring)."""

    def __init__(
        self,
        lookup: LookupFn,
        lease: LeaseFn,
        block_tokens: int,
        page_tokens: int,
        kv_cache_manager: Any = None,
        async_save: bool = False,
    ) -> None:
        self._lookup = lookup
        self._lease = lease
        self._bt = block_tokens
        self._bs = page_tokens
        self._reqs: dict[str, _Req] = {}
        self.kv_cache_manager = kv_cache_manager
        self.async_save = async_save
        self.uncacheable = 0
        self._uncacheable: set[str] = set()  # ids of such requests not finished yet
        self.lookups = 0
        self.hit_tokens = 0

    def _state(self, request: Any) -> _Req:
        st = self._reqs.get(request.request_id)
        if st is None or st.request is not request:
            st = self._reqs[request.request_id] = _Req(request, request_scope(request))
        return st

    def matched(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens beyond ``num_computed_tokens`` that kvtier will load (a multiple of vLLM's
        block size; 0 on a miss)."""
        if not cacheable(request):
            if request.request_id not in self._uncacheable:  # vLLM may ask again
                self._uncacheable.add(request.request_id)
                self.uncacheable += 1
            return 0
        st = self._state(request)
        tokens = request.all_token_ids
        limit = (len(tokens) - 1) // self._bt * self._bt  # leave >= 1 token to compute
        st.local, st.held, st.load_end = num_computed_tokens, 0, 0
        if limit <= 0:
            return 0
        self.lookups += 1
        # a one-block probe first: a miss costs O(block_tokens), not O(prompt)
        head = np.asarray(tokens[: self._bt], dtype=np.int32)
        if self._lookup(head, st.scope, 0) < self._bt:
            return 0
        end = self._lookup(np.asarray(tokens[:limit], dtype=np.int32), st.scope, 0)
        end = min(end, limit) // self._bt * self._bt
        st.held = end
        if end <= num_computed_tokens:
            return 0
        st.load_end = end
        self.hit_tokens += end - num_computed_tokens
        return end - num_computed_tokens

    def after_alloc(self, request: Any, num_external_tokens: int) -> None:
        """vLLM allocated pages; ``num_external_tokens`` > 0 commits the load ``matched``
        offered (vLLM may grant 0, e.g. when the request skips prefix-cache reads)."""
        st = self._reqs.get(request.request_id)
        if st is None:
            return
        st.pending_load = num_external_tokens > 0 and st.local + num_external_tokens == st.load_end
        if st.pending_load:  # committed: hold the blocks on every rank until the load
            tokens = np.asarray(request.all_token_ids[: st.load_end], dtype=np.int32)
            self._lease(request.request_id, tokens, st.scope, st.local // self._bt * self._bt)

    def _pages(self, req_id: str) -> list[int]:
        return list(self.kv_cache_manager.get_block_ids(req_id)[0])

    def build(self, scheduler_output: Any) -> KvtierMetadata:
        """This step's loads and saves (does not modify ``scheduler_output``)."""
        meta = KvtierMetadata(
            preempted=set(getattr(scheduler_output, "preempted_req_ids", None) or ())
        )
        bt, bs = self._bt, self._bs
        computed: dict[str, int] = {
            r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs
        }
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for req_id, n_new in scheduler_output.num_scheduled_tokens.items():
            st = self._reqs.get(req_id)
            if st is None or not cacheable(st.request):
                continue
            pages: list[int] | None = None
            tokens = st.request.all_token_ids
            if st.pending_load:
                st.pending_load = False
                pages = self._pages(req_id)
                lo = st.local // bt * bt
                meta.loads.append(
                    PageOp(
                        req_id,
                        np.asarray(tokens[: st.load_end], dtype=np.int32),
                        lo,
                        st.load_end,
                        tuple(pages[lo // bs : st.load_end // bs]),
                        st.scope,
                        keep_pages=(st.local - lo) // bs,
                    )
                )
            done = min(computed.get(req_id, 0) + n_new, len(tokens)) // bt * bt
            if done > st.held:
                pages = pages if pages is not None else self._pages(req_id)
                if len(pages) * bs >= done:
                    meta.saves.append(
                        PageOp(
                            req_id,
                            np.asarray(tokens[:done], dtype=np.int32),
                            st.held,
                            done,
                            tuple(pages[st.held // bs : done // bs]),
                            st.scope,
                        )
                    )
                    st.held = done
                    st.saved = True
        return meta

    def load_failed(self, block_ids: set[int]) -> None:
        """Pages a worker could not load (vLLM recomputes them): kvtier does not hold those
        blocks after all, so saving restarts at the first one."""
        if not block_ids or self.kv_cache_manager is None:
            return
        for req_id, st in self._reqs.items():
            try:
                pages = self._pages(req_id)
            except (KeyError, AssertionError):  # a request vLLM no longer holds pages for
                continue
            bad = [i for i, p in enumerate(pages) if p in block_ids]
            if bad:
                st.held = min(st.held, bad[0] * self._bs // self._bt * self._bt)

    def stats(self) -> dict[str, int]:
        return {
            "lookups": self.lookups,
            "hit_tokens": self.hit_tokens,
            "uncacheable": self.uncacheable,
        }

    def finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """Forget ``request``: (whether vLLM must keep its pages until the workers report its
        async saves done, ``get_finished``; the ``kv_transfer_params`` for its output)."""
        if request.request_id in self._uncacheable:
            self._uncacheable.discard(request.request_id)
            return False, {"kvtier": "uncacheable"}
        st = self._reqs.pop(request.request_id, None)
        return self.async_save and st is not None and st.saved, None
