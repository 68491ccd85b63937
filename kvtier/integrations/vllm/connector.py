"""``KvtierConnector``: kvtier as a vLLM v1 KV connector.

Enable with::

    KVTransferConfig(
        kv_connector="KvtierConnector",
        kv_connector_module_path="kvtier.integrations.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"kvtier_config": "/etc/kvtier.toml"},
    )

vLLM builds one instance in the scheduler's process (``SchedulerSide``: lookups, load/save
plans) and one per worker rank (``WorkerSide``: the rank's store and the page moves). Bad
settings raise ``ConfigError`` from the constructor, so the engine refuses to start, with a
message naming the setting. The connector is a best-effort cache: a load it cannot deliver is
recomputed by vLLM (it sets ``kv_load_failure_policy = "recompute"``, the only policy that
never fails a request for a cache fault).

With a ``[service] url`` in the config (service mode) the ranks use the node service
(``service_backend``) and the scheduler asks the service itself (``service_lookup``), with the
identities the ranks registered (vLLM's handshake metadata); otherwise each rank owns a store
and the scheduler asks the ranks (``lookup_rpc``).
"""

from __future__ import annotations

import logging
import platform
from dataclasses import replace
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
)

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.backend import open_local
from kvtier.integrations.vllm.format import (
    check_cache_dtype,
    engine_tag,
    scales_digest,
)
from kvtier.integrations.vllm.identity import engine_identity, model_name
from kvtier.integrations.vllm.lookup_rpc import LookupClient, LookupServer
from kvtier.integrations.vllm.metadata import KvtierMetadata, LoadedRequests, RankHandshake
from kvtier.integrations.vllm.movers import make_mover
from kvtier.integrations.vllm.pages import element_dtype, page_layout
from kvtier.integrations.vllm.scheduler import SchedulerSide
from kvtier.integrations.vllm.service_backend import open_service
from kvtier.integrations.vllm.service_lookup import ServiceLookup
from kvtier.integrations.vllm.settings import ConnectorSettings, parse_settings
from kvtier.integrations.vllm.worker import WorkerSide
from kvtier.layout import KVLayout

# a child of vLLM's logger: its handlers (and VLLM_LOGGING_LEVEL) show kvtier's lines too
log = logging.getLogger("vllm.kvtier")


def _attention_spec(kv_cache_config: Any) -> Any:
    """The one full-attention spec kvtier can store (``ConfigError`` for anything else)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    groups = list(kv_cache_config.kv_cache_groups) if kv_cache_config is not None else []
    if len(groups) != 1:
        raise ConfigError(
            f"kvtier's vLLM connector supports one KV cache group (full attention); this model "
            f"has {len(groups)} (a hybrid model); run it without kv_connector=KvtierConnector"
        )
    spec = groups[0].kv_cache_spec
    if type(spec) is not FullAttentionSpec or getattr(spec, "sliding_window", None):
        raise ConfigError(
            f"kvtier's vLLM connector supports full attention only, got {type(spec).__name__}"
            "; run this model without kv_connector=KvtierConnector"
        )
    return spec


def _isa(vllm_config: Any, device: str) -> str:
    """What else than the tensor shape changes a page's bytes on this device: the CPU
    backend's ISA packing; on CUDA, the compute capability (kernels differ per architecture)."""
    cache, mc = vllm_config.cache_config, vllm_config.model_config
    if device == "cpu":
        try:
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            return str(
                _get_attn_isa(mc.dtype, cache.block_size, mc.get_head_size(), cache.cache_dtype)
            )
        except Exception:  # an older/newer vLLM: name the machine's vector units instead
            return f"{platform.machine()}-avx512={torch.cpu._is_avx512_supported()}"
    if device == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"sm{major}{minor}"
    return "-"


def _attention_layers(vllm_config: Any, names: list[str]) -> list[Any]:
    """vLLM's attention modules of ``names`` (``ConfigError`` if one is not registered)."""
    ctx = vllm_config.compilation_config.static_forward_context
    missing = [n for n in names if n not in ctx]
    if missing:
        raise ConfigError(f"kvtier: vLLM registered KV caches for unknown layers {missing[:3]}")
    return [ctx[n] for n in names]


def _backend_name(layers: list[Any]) -> str:
    names = {str(layer.get_attn_backend().get_name()) for layer in layers}
    if len(names) != 1:
        raise ConfigError(
            f"kvtier's vLLM connector needs one attention backend for every layer, got "
            f"{sorted(names)}"
        )
    return names.pop()


def _scales(layers: list[Any]) -> list[tuple[list[float], list[float]]]:
    """Every layer's fp8 k/v scales as vLLM fixed them after loading the weights."""

    def values(layer: Any, name: str) -> list[float]:
        t = getattr(layer, name, None)
        if t is None:
            return []
        return [float(x) for x in torch.as_tensor(t).detach().float().cpu().reshape(-1).tolist()]

    return [(values(layer, "_k_scale"), values(layer, "_v_scale")) for layer in layers]


class KvtierConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """kvtier behind vLLM's ``KVConnectorBase_V1`` (see the module docstring)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        self._settings: ConnectorSettings = parse_settings(
            ktc.kv_connector_extra_config, vllm_config.cache_config.block_size
        )
        self._engine_id = str(ktc.engine_id)
        pc = vllm_config.parallel_config
        self._ranks = int(pc.tensor_parallel_size) * int(pc.pipeline_parallel_size)
        self._sched: SchedulerSide | None = None
        self._client: LookupClient | None = None
        self._service: ServiceLookup | None = None
        self._worker: WorkerSide | None = None
        self._handshake: RankHandshake | None = None
        self._loaded: set[str] = set()  # service mode: requests loaded since the last step
        self._layer_index: dict[str, int] = {}
        check_cache_dtype(str(vllm_config.cache_config.cache_dtype))
        from vllm.platforms import current_platform

        self._async_save = self._settings.use_async_save(bool(current_platform.is_cuda_alike()))
        if role == KVConnectorRole.SCHEDULER:
            spec = _attention_spec(kv_cache_config)
            # check the config against the layout now: the engine refuses to start on a bad one
            layers = len(kv_cache_config.kv_cache_groups[0].layer_names)
            per_token = spec.head_size + getattr(spec, "head_size_v", spec.head_size)
            layout = KVLayout(
                layers,
                spec.num_kv_heads,
                per_token,
                element_dtype(spec.dtype, str(vllm_config.cache_config.cache_dtype)),
                1,
                self._settings.block_tokens,
            )
            self._settings.store_config(layout, *model_name(vllm_config, self._settings.model_id))
            self._settings.check_service_layout(layout)
            if ktc.kv_load_failure_policy != "recompute":
                log.info(
                    "kvtier: kv_load_failure_policy set to 'recompute' (cache faults recompute)"
                )
                ktc.kv_load_failure_policy = "recompute"
            service = self._settings.service
            if service is not None:  # the ranks' identities arrive with vLLM's handshake
                self._service = ServiceLookup(
                    service.url,
                    self._settings.lookup_timeout_s,
                    name=f"vllm-scheduler-{self._engine_id}",
                    tenant=self._settings.tenant,
                )
                lookups: Any = self._service
            else:
                lookups = self._client = LookupClient(
                    self._engine_id, self._ranks, self._settings.lookup_timeout_s
                )
            self._sched = SchedulerSide(
                lookups.lookup,
                lookups.lease,
                self._settings.block_tokens,
                vllm_config.cache_config.block_size,
                async_save=self._async_save,
            )

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped save is a later miss, never a lost result

    # -- scheduler side ----------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._sched is not None:
            self._sched.kv_cache_manager = kv_cache_manager

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        assert self._sched is not None
        return self._sched.matched(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._sched is not None
        self._sched.after_alloc(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KvtierMetadata:
        assert self._sched is not None
        return self._sched.build(scheduler_output)

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        """Service mode: every rank's identity and layout, once the ranks registered."""
        if self._service is not None:
            self._service.attach(metadata)

    def update_connector_output(self, connector_output: Any) -> None:
        if self._sched is not None:
            self._sched.load_failed(set(getattr(connector_output, "invalid_block_ids", ()) or ()))
        loaded = getattr(connector_output, "kv_connector_worker_meta", None)
        if self._service is not None and isinstance(loaded, LoadedRequests):
            self._service.release(loaded.req_ids)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self._service is not None:
            self._service.release((request.request_id,))
        if self._sched is not None:
            return self._sched.finished(request)
        return False, None

    # -- worker side -------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        cfg = self._vllm_config
        names = list(kv_caches)
        layers = _attention_layers(cfg, names)
        caches = [kv_caches[n] for n in names]
        mc, cache = cfg.model_config, cfg.cache_config
        pages = page_layout(
            caches,
            backend=_backend_name(layers),
            block_size=cache.block_size,
            kv_heads=mc.get_num_kv_heads(cfg.parallel_config),
            head_size=mc.get_head_size(),
            cache_dtype=str(cache.cache_dtype),
        )
        device = caches[0].device.type
        cache_dtype = str(cache.cache_dtype)
        scales = "-"
        if check_cache_dtype(cache_dtype) == "per-tensor":
            scales = scales_digest(_scales(layers))
        tag = engine_tag(
            device=device,
            isa=_isa(cfg, device),
            pages=pages,
            block_size=cache.block_size,
            cache_dtype=cache_dtype,
            scales=scales,
        )
        tp, pp = get_tp_group(), get_pp_group()
        ident = engine_identity(
            cfg,
            tag,
            self._settings.model_id,
            (tp.rank_in_group, tp.world_size),
            (pp.rank_in_group, pp.world_size),
        )
        sc = self._settings.store_config(
            pages.kvtier_layout(self._settings.block_tokens), ident.model_id, ident.revision
        )
        mover = make_mover(caches, pages)
        # the config may name another revision than vLLM's (it names the weights)
        ident = replace(ident, revision=sc.identity.revision)
        rank = pp.rank_in_group * tp.world_size + tp.rank_in_group
        service = self._settings.service
        backend: Any
        if service is not None:
            backend = open_service(
                service.url,
                ident,
                sc.layout,
                timeout=service.timeout,
                name=f"vllm-{self._engine_id}-rank{rank}",
                tenant=self._settings.tenant,
            )
            self._handshake = RankHandshake(ident, sc.layout)
        else:
            backend = open_local(sc, ident)
        # per-layer waits only where every attention layer runs its Python hooks (eager):
        # a CUDA graph replays the forward without them
        eager = bool(mc.enforce_eager) or str(
            getattr(cfg.compilation_config, "cudagraph_mode", "NONE")
        ).endswith("NONE")
        self._layer_index = {n: i for i, n in enumerate(names)}
        self._worker = WorkerSide(
            backend,
            mover,
            async_save=self._async_save,
            save_queue_bytes=self._settings.save_queue_bytes,
            layerwise=device == "cuda" and eager,
        )
        worker = self._worker
        self._worker.serve(
            LookupServer(
                self._engine_id,
                rank,
                backend.lookup,
                worker.lease,
                lambda: {**worker.stats(), "engine_tag": tag},
            )
        )
        where = f"uses kvtier serve at {service.url}" if service else "store ready"
        log.info("kvtier: rank %d %s (%s)", rank, where, ident.engine_tag)

    def get_handshake_metadata(self) -> RankHandshake | None:
        return self._handshake  # service mode: what the scheduler looks up under

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        if self._worker is not None and isinstance(kv_connector_metadata, KvtierMetadata):
            self._worker.preempted(kv_connector_metadata.preempted)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if self._worker is not None and isinstance(meta, KvtierMetadata):
            self._worker.load(meta)
            if self._handshake is not None:
                self._loaded.update(op.req_id for op in meta.loads)

    def build_connector_worker_meta(self) -> LoadedRequests | None:
        """Service mode: the requests this step loaded (the scheduler holds their leases)."""
        if not self._loaded:
            return None
        done, self._loaded = frozenset(self._loaded), set()
        return LoadedRequests(done)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None and self._worker.layerwise:
            layer = self._layer_index.get(layer_name)
            if layer is not None:
                self._worker.wait_layer(layer)

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # saves run once per step in wait_for_save, from whole pages

    def wait_for_save(self) -> None:
        if self._worker is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, KvtierMetadata):
            self._worker.save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None or not finished_req_ids:
            return None, None
        return self._worker.finished(finished_req_ids) or None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def shutdown(self) -> None:
        if self._sched is not None:
            log.info("kvtier scheduler: %s", self._sched.stats())
        if self._worker is not None:
            log.info("kvtier worker: %s", self._worker.stats())
            self._worker.close()
            self._worker = None
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._service is not None:
            self._service.close()
            self._service = None


def transfer_config(kvtier_config: Any, **extra: Any) -> Any:
    """vLLM's ``KVTransferConfig`` that enables kvtier: ``kvtier_config`` is a TOML path or
    the config's table; ``extra`` adds keys to ``kv_connector_extra_config``."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="KvtierConnector",
        kv_connector_module_path="kvtier.integrations.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"kvtier_config": kvtier_config, **extra},
    )
