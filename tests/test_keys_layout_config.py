"""Keys, layouts, presets, config parsing and the planner's arithmetic."""

from __future__ import annotations

import inspect
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.config import StoreConfig, parse_bool, parse_int, parse_size
from kvtier.errors import ConfigError, LayoutError, TokenError
from kvtier.identity import Identity, Scope
from kvtier.keys import Namespace, TokenIds, as_tokens, block_keys
from kvtier.layout import KVLayout, canonical_dtype, load_presets, preset
from kvtier.plan import make_plan
from kvtier.policy import DEFAULT_POLICY
from kvtier.store import TieredStore
from kvtier.tiers.nvme import NVMeTier

LAY = KVLayout(2, 2, 4, "fp16", block_tokens=4)


def ns(tenant: str = "t", model: str = "model", layout: KVLayout = LAY, **kw: object) -> Namespace:
    return Namespace(Identity(model), layout, Scope(tenant), **kw)  # type: ignore[arg-type]


def test_keys_are_chained_32_byte_digests() -> None:
    a = block_keys(ns(), [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert len(a) == 2 and all(len(k) == 32 for k in a)  # only full blocks
    b = block_keys(ns(), [1, 2, 3, 4, 5, 6, 7, 0])
    assert a[0] == b[0] and a[1] != b[1]
    c = block_keys(ns(), [0, 2, 3, 4, 5, 6, 7, 8])
    assert c[1] != a[1]  # same tokens, different parent


def test_keys_do_not_depend_on_input_type() -> None:
    toks = [5, 6, 7, 8, 1, 2, 3, 4]
    ref = block_keys(ns(), toks)
    for form in (
        np.array(toks, np.int64),
        np.array(toks, np.uint32),
        tuple(toks),
        np.array([toks], np.int32),
    ):
        assert block_keys(ns(), form) == ref


def test_namespaces_separate_tenants_models_layouts_and_secrets() -> None:
    toks = list(range(8))
    base = block_keys(ns(), toks)
    assert block_keys(ns("other"), toks) != base
    assert block_keys(ns(model="model-2"), toks) != base
    assert block_keys(ns(layout=KVLayout(2, 2, 4, "bf16", block_tokens=4)), toks) != base
    assert block_keys(ns(secret=b"s3cret"), toks) != base
    long = b"k" * 64
    assert block_keys(ns(secret=long + b"1"), toks) != block_keys(ns(secret=long + b"2"), toks)
    g1 = block_keys(ns("a", share_group="g"), toks)
    assert g1 == block_keys(ns("b", share_group="g"), toks)


@pytest.mark.parametrize(
    "bad",
    [
        [1.0, 2.0],
        [True, False],
        [[1, 2]],
        [-1, 3, 4, 5],
        [2**32, 1, 2, 3],
        [1, [2, 3], 4, 5],
        np.array([0.5]),
        "abcd",
    ],
)
def test_bad_tokens_raise(bad: object) -> None:
    with pytest.raises(TokenError):
        block_keys(ns(), bad * 2 if isinstance(bad, list) else bad)


def test_as_tokens_converts_to_uint32() -> None:
    arr = as_tokens([1, 2, 3])
    assert arr.dtype == np.dtype("<u4") and arr.tolist() == [1, 2, 3]
    assert len(TokenIds(range(10))) == 10


def test_layout_bytes_and_fingerprint() -> None:
    llama = preset("llama-3.1-8b").layout("bf16")
    assert llama.bytes_per_token == 128 * 1024
    assert llama.block_bytes == 32 * 2**20
    assert llama.layer_block_bytes * 32 == llama.block_bytes
    gpt3 = preset("GPT-3-175B").layout("fp16")
    assert gpt3.bytes_per_token == int(4.5 * 2**20)
    assert gpt3.bytes_per_token * 32768 == 144 * 2**30
    ds = preset("DeepSeek-V3").layout("fp16")
    assert ds.kv_factor == 1 and ds.bytes_per_token == 61 * 576 * 2
    assert llama.fingerprint != preset("llama-3.1-8b").layout("fp16").fingerprint
    assert len(load_presets()) == 10


def test_layout_validation() -> None:
    with pytest.raises(LayoutError):
        KVLayout(0, 1, 1)
    with pytest.raises(LayoutError):
        KVLayout(1, 1, 1, kv_factor=3)
    with pytest.raises(ConfigError, match="unknown dtype"):
        canonical_dtype("int4")
    with pytest.raises(ConfigError, match="known"):
        preset("no-such-model")
    assert canonical_dtype("BF16") == "bfloat16" and canonical_dtype("fp8") == "float8_e4m3fn"


def test_parse_size() -> None:
    assert parse_size("8GiB") == 8 * 2**30
    assert parse_size("80GB") == 80 * 10**9
    assert parse_size("1.5 MiB") == 1572864
    assert parse_size(4096) == 4096
    for bad in ("lots", "8XB", -1, True):
        with pytest.raises(ConfigError):
            parse_size(bad)  # type: ignore[arg-type]


def test_config_validation_and_env_overrides() -> None:
    raw = {
        "store": {"model": "Llama-3.1-8B", "dtype": "bf16", "model_id": "llama"},
        "tiers": [{"kind": "host", "capacity": "1GiB"}],
    }
    cfg = StoreConfig.from_dict(raw, env={"KVTIER_POLICY": "lru", "KVTIER_TIER0_CAPACITY": "2GiB"})
    assert cfg.policy == "lru" and cfg.tiers[0]["capacity"] == "2GiB"
    assert cfg.layout.dtype == "bfloat16"
    # KVTIER_PURE chose a compiled build that is gone: no store key, no error
    assert StoreConfig.from_dict(raw, env={"KVTIER_PURE": "1"}).tiers[0]["capacity"] == "1GiB"
    with pytest.raises(ConfigError, match="unknown key"):
        StoreConfig.from_dict({"store": {"model": "Llama-3.1-8B", "colour": 1}}, env={})
    with pytest.raises(ConfigError, match="layers"):
        StoreConfig.from_dict({"store": {"layers": 2}}, env={})
    with pytest.raises(ConfigError, match="no tier #3"):
        StoreConfig.from_dict(raw, env={"KVTIER_TIER3_CAPACITY": "1"})


STORE = {"layers": 2, "kv_heads": 2, "head_dim": 4, "block_tokens": 4, "model_id": "m"}
HOST = [{"kind": "host", "capacity": "1MiB"}]


def cfg(**store: object) -> dict[str, Any]:
    return {"store": {**STORE, **store}, "tiers": HOST}


def test_config_policy_default_is_the_constructors() -> None:
    """README: ``policy = "auto"  # the default``, from a config file as from the constructor."""
    assert StoreConfig.from_dict(cfg(), env={}).policy == DEFAULT_POLICY == "auto"
    assert inspect.signature(TieredStore).parameters["policy"].default == DEFAULT_POLICY


def test_config_naming_a_removed_policy_says_what_to_use() -> None:
    with pytest.raises(ConfigError, match=r"policy 'density' was removed; use 'auto'"):
        StoreConfig.from_dict(cfg(policy="density"), env={})


def test_a_tier_may_name_its_own_policy(tmp_path: Path) -> None:
    tiers = [
        {"kind": "host", "capacity": "64KiB", "policy": "lru"},
        {"kind": "nvme", "capacity": "1MiB", "paths": [str(tmp_path)], "o_direct": "never"},
    ]
    raw = {"store": {**STORE, "policy": "s3fifo"}, "tiers": tiers}
    c = StoreConfig.from_dict(raw, env={})
    assert c.tier_policies == ("lru", None) and "policy" not in c.tiers[0]
    with TieredStore.from_config(c) as store:
        kinds = [p["policy"] for p in store.stats()["policies"].values()]
    assert kinds == ["lru", "s3fifo"]  # the tier's own, else the store's
    env = {"KVTIER_TIER1_POLICY": "auto"}
    assert StoreConfig.from_dict(raw, env=env).tier_policies == ("lru", "auto")
    assert StoreConfig.from_dict(cfg(), env={}).tier_policies == ()  # none named: the store's
    with pytest.raises(ConfigError, match=r"\[\[tiers\]\] #0 \(host\) policy: unknown policy"):
        StoreConfig.from_dict({"store": STORE, "tiers": [{**HOST[0], "policy": "mru"}]}, env={})
    with pytest.raises(ConfigError, match=r"policy 'density' was removed"):
        StoreConfig.from_dict({"store": STORE, "tiers": [{**HOST[0], "policy": "density"}]}, {})


def test_config_reads_env_strings_as_numbers_and_secrets() -> None:
    env = {"KVTIER_WORKERS": "4", "KVTIER_METRICS_PORT": "0", "KVTIER_SECRET": "s3cret"}
    c = StoreConfig.from_dict(cfg(share_groups={"a": "g"}), env=env)
    assert (c.workers, c.metrics_port, c.secret, c.share_groups) == (4, 0, b"s3cret", {"a": "g"})


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("workers", "two"),
        ("workers", 1.7),
        ("workers", True),
        ("workers", 0),
        ("workers", 10**6),
        ("demote_queue", "x"),
        ("demote_queue", 0),
        ("metrics_port", -1),
        ("metrics_port", 99999),
        ("metrics_port", "x"),
        ("block_tokens", 2.9),
        ("block_tokens", -4),
        ("layers", "2x"),
        ("layers", 0),
        ("kv_heads", 2.5),
        ("head_dim", [4]),
        ("kv_factor", 3),
        ("kv_factor", 1.0),
        ("tenant", ""),
        ("tenant", 5),
        ("share_groups", 7),
        ("share_groups", {"a": ""}),
        ("share_groups", {"a": 5}),
        ("share_group", "g"),
        ("weights_version", "v1"),
        ("revision", 3),
        ("secret", 16),
        ("secret", [1, 2]),
        ("secret", ""),
        ("policy", "fifo"),
        ("policy", 3),
        ("dtype", 16),
        ("model_id", 3),
        ("model_id", ""),
    ],
)
def test_bad_store_values_name_the_key_and_value(key: str, value: object) -> None:
    with pytest.raises(ConfigError) as exc:
        StoreConfig.from_dict(cfg(**{key: value}), env={})
    msg = str(exc.value)
    assert key in msg
    if key != "secret":  # a secret is never echoed
        assert repr(value) in msg


def test_a_preset_with_a_shape_key_is_an_error() -> None:
    with pytest.raises(ConfigError, match="kv_factor"):
        StoreConfig.from_dict({"store": {"model": "Llama-3.1-8B", "kv_factor": 1}}, env={})


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("KVTIER_WORKERS", "two"),
        ("KVTIER_WORKERS", "1.7"),
        ("KVTIER_METRICS_PORT", "99999"),
        ("KVTIER_POLICYY", "lru"),
        ("KVTIER_TENANT", ""),
    ],
)
def test_bad_env_overrides_name_the_variable(name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=name):
        StoreConfig.from_dict(cfg(), env={name: value})


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ({"store": "x"}, "store"),
        ({"store": STORE, "tiers": ["host"]}, "tiers"),
        ({"store": STORE, "tiers": {"kind": "host"}}, "tiers"),
        ({"store": STORE, "tiers": [{"kind": 5}]}, "kind"),
        ([("store", STORE)], "config"),
    ],
)
def test_malformed_config_structure_is_a_config_error(raw: Any, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        StoreConfig.from_dict(raw, env={})


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan, "inf", "nan"])
def test_non_finite_sizes_are_config_errors(bad: object) -> None:
    with pytest.raises(ConfigError, match="capacity"):
        parse_size(bad, "capacity")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="capacity"):
        TieredStore.from_config({"store": STORE, "tiers": [{"kind": "host", "capacity": bad}]})


def test_unreadable_config_files_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=re.escape(str(tmp_path))):
        StoreConfig.from_file(tmp_path, env={})  # a directory
    binary = tmp_path / "bin.toml"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError, match=r"bin\.toml.*UTF-8"):
        StoreConfig.from_file(binary, env={})
    bad = tmp_path / "bad.toml"
    bad.write_text('[store]\nlayers = 2\nkv_heads = 2\nhead_dim = 4\nworkers = "two"\n')
    with pytest.raises(ConfigError, match=r"bad\.toml.*workers.*'two'"):
        StoreConfig.from_file(bad, env={})


@pytest.mark.parametrize(
    ("text", "value"),
    [("1", True), ("0", False), ("TRUE", True), ("false", False), (" Yes ", True)]
    + [("no", False), ("On", True), ("off", False), (True, True), (False, False)],
)
def test_parse_bool_accepts_toml_booleans_and_a_clear_set_of_words(
    text: object, value: bool
) -> None:
    assert parse_bool(text, "x") is value


@pytest.mark.parametrize("bad", ["ture", "", "2", "y", 1, 0, 1.0, None])
def test_parse_bool_rejects_everything_else(bad: object) -> None:
    with pytest.raises(ConfigError, match="warm_restart"):
        parse_bool(bad, "warm_restart")


def test_parse_int_range_and_types() -> None:
    assert parse_int(" 8 ", "n", 1, 8) == 8 and parse_int(-2, "n", -5) == -2
    for bad in (9, 0, "1e3", "0x10", "1_0", 2.0, False, None):
        with pytest.raises(ConfigError, match=r"^n: "):
            parse_int(bad, "n", 1, 8)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("warm_restart", "ture"),
        ("warm_restart", 2),
        ("workers", -3),
        ("workers", "two"),
        ("workers", 1.5),
        ("paths", 5),
        ("paths", [5]),
        ("paths", [""]),
        ("capacity", math.inf),
        ("capacity", math.nan),
    ],
)
def test_bad_nvme_values_name_the_key(tmp_path: Path, key: str, value: object) -> None:
    spec = {"paths": [str(tmp_path)], "capacity": "1MiB", key: value}
    with pytest.raises(ConfigError, match=key):
        NVMeTier.from_config(LAY, spec)


def test_a_typo_in_warm_restart_does_not_throw_the_cache_away(tmp_path: Path) -> None:
    raw = {
        "store": STORE,
        "tiers": [{"kind": "nvme", "capacity": "1MiB", "paths": [str(tmp_path)]}],
    }
    kv = np.ones(LAY.kv_shape(8), np.float16)
    with TieredStore.from_config(raw, env={}) as s:
        s.store(list(range(8)), kv)
    with pytest.raises(ConfigError, match=r"warm_restart.*'ture'"):
        TieredStore.from_config(raw, env={"KVTIER_TIER0_WARM_RESTART": "ture"})
    with TieredStore.from_config(raw, env={"KVTIER_TIER0_WARM_RESTART": "ON"}) as s:
        assert s.lookup(list(range(8))) == 8
    with TieredStore.from_config(raw, env={"KVTIER_TIER0_WARM_RESTART": "off"}) as s:
        assert s.lookup(list(range(8))) == 0


@pytest.mark.parametrize(
    ("module", "spec", "key"),
    [
        ("redis", {"tls": "ture"}, "tls"),
        ("redis", {"tls_verify": "nope"}, "tls_verify"),
        ("redis", {"ttl": 1.5}, "ttl"),
        ("redis", {"timeout": "fast"}, "timeout"),
        ("redis", {"cooldown": "nan"}, "cooldown"),
        ("s3", {"bucket": "b", "create_bucket": "ture"}, "create_bucket"),
        ("s3", {"bucket": "b", "workers": "two"}, "workers"),
        ("s3", {"bucket": "b", "ttl_days": 2.5}, "ttl_days"),
        ("s3", {"bucket": "b", "timeout": "x"}, "timeout"),
        ("mooncake", {"master": "h:1", "replicas": "two"}, "replicas"),
        ("mooncake", {"master": "h:1", "rpc_timeout_s": "inf"}, "rpc_timeout_s"),
    ],
)
def test_bad_remote_tier_values_name_the_key(module: str, spec: dict[str, Any], key: str) -> None:
    from kvtier.tiers.registry import make_tier

    pytest.importorskip({"s3": "boto3"}.get(module, module))
    with pytest.raises(ConfigError, match=key):
        make_tier(LAY, {"kind": module, **spec}).close()


def test_plan_uses_the_kv_formula_not_parameter_count() -> None:
    gpt3 = preset("GPT-3-175B")
    plan = make_plan(gpt3.layout("fp16"), context_tokens=32768, params=gpt3.params)
    assert plan.kv_bytes_total == 144 * 2**30
    assert plan.wrong_formula_bytes > 1000 * plan.kv_bytes_total
    # tensor parallel wider than the KV heads duplicates heads
    llama = preset("Llama-3.1-70B").layout("fp16")
    assert make_plan(llama, context_tokens=1, tp=8).kv_bytes_per_token == llama.bytes_per_token
    p16 = make_plan(llama, context_tokens=1, tp=16)
    assert p16.kv_bytes_per_token == 2 * llama.bytes_per_token
    assert p16.kv_bytes_per_token_per_gpu == llama.bytes_per_token // 8


def test_fp8_variants_are_different_formats() -> None:
    torch = pytest.importorskip("torch")
    from kvtier.kvarray import host_array

    e4m3 = KVLayout(2, 2, 4, "fp8", block_tokens=4)
    e5m2 = KVLayout(2, 2, 4, "float8_e5m2", block_tokens=4)
    assert e4m3.fingerprint != e5m2.fingerprint
    assert block_keys(ns(layout=e4m3), range(4)) != block_keys(ns(layout=e5m2), range(4))
    kv = torch.zeros(e4m3.kv_shape(4), dtype=torch.float8_e5m2)
    with pytest.raises(LayoutError, match="float8_e5m2"):
        host_array(kv, e4m3, "kv")
    assert host_array(kv, e5m2, "kv").dtype == np.uint8


def test_torch_integer_carriers_are_accepted_like_numpy_ones() -> None:
    torch = pytest.importorskip("torch")
    from kvtier.kvarray import host_array

    bf16 = KVLayout(2, 2, 4, "bf16", block_tokens=4)
    src = torch.randn(bf16.kv_shape(4), dtype=torch.bfloat16)
    for carrier in (torch.int16, torch.uint16):
        arr = host_array(src.view(carrier), bf16, "kv")
        assert arr.dtype == np.uint16
        assert np.array_equal(arr, host_array(src, bf16, "kv"))  # the same bytes, no copy
    for wrong in (torch.int32, torch.int8, torch.bool, torch.float16):
        with pytest.raises(LayoutError, match="dtype"):
            host_array(torch.zeros(bf16.kv_shape(4), dtype=wrong), bf16, "kv")


def test_batch_checksums_match_one_by_one() -> None:
    """``codec.checksums`` splits large batches over threads; the sums must not change."""
    from kvtier import codec

    rng = np.random.default_rng(3)
    small = [rng.integers(0, 255, 1000, dtype=np.uint8) for _ in range(3)]
    large = [rng.integers(0, 255, 3 << 20, dtype=np.uint8) for _ in range(7)]  # 21 MiB: threads
    for batch in (small, large, large[:1], []):
        assert codec.checksums(batch) == [codec.checksum(b) for b in batch]


@pytest.mark.parametrize(
    "shape, view",
    [
        ((4, 2, 48, 2, 8), (slice(None), slice(None), slice(16, 32))),  # a block of a kv buffer
        ((3, 2, 1 << 16, 2, 8), (slice(None), slice(None), slice(0, 1 << 15))),  # rows > 1 MiB
        ((5, 7, 3), (slice(None), slice(1, 6))),  # rows that are not contiguous runs
        ((64,), (slice(None, None, 2),)),  # 1-D, strided
        ((0, 2, 4), (slice(None), slice(0, 1))),  # empty
    ],
)
def test_copies_reach_every_byte_of_any_strided_buffer(
    shape: tuple[int, ...], view: tuple[slice, ...]
) -> None:
    """``copy_in`` / ``copy_out`` / ``copy_plain`` between a contiguous block and a strided view
    move every byte once, in C order, with the checksum of those bytes; nothing outside the view
    is touched."""
    from kvtier import codec

    rng = np.random.default_rng(5)
    big = rng.integers(0, 2**16, shape, dtype=np.uint16)
    src = big[view]
    block = np.empty(src.nbytes, np.uint8)
    assert codec.copy_in(block, src) == codec.checksum(np.ascontiguousarray(src))
    assert block.tobytes() == src.tobytes()
    for copy, expect in ((codec.copy_out, codec.checksum(block)), (codec.copy_plain, None)):
        dst_big = np.zeros_like(big)
        dst = dst_big[view]
        assert copy(dst, block) == expect  # copy_out returns the checksum, copy_plain nothing
        assert np.array_equal(dst, src)
        dst_big[view] = 0
        assert not dst_big.any()
    with pytest.raises(LayoutError, match="bytes"):
        codec.copy_out(src, block[1:] if block.size else np.empty(1, np.uint8))


def test_header_room_only_for_whole_framed_payloads() -> None:
    from kvtier import codec

    payload = codec.framed_empty(4096)
    room = codec.header_room(payload)
    assert room is not None and room.nbytes == codec.HEADER_BYTES
    assert room.ctypes.data + codec.HEADER_BYTES == payload.ctypes.data
    shaped = payload.view(np.uint16).reshape(2, 1024)  # a reshaped view of the whole payload
    assert codec.header_room(shaped) is not None
    assert codec.header_room(payload[8:]) is None  # part of it: the room is not right before
    assert codec.header_room(payload[:-8]) is None
    assert codec.header_room(np.zeros(4096, np.uint8)) is None  # a plain array
    assert codec.header_room(shaped[:, ::2]) is None  # not contiguous
