"""HF transformers integration: a cached prefix gives exactly the output of a plain run.

A tiny random model (4 layers, hidden 128, GQA 4:2) on CPU in fp32; blocks of 16 tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


from kvtier.errors import ConfigError, LayoutError, TokenError  # noqa: E402
from kvtier.identity import Identity  # noqa: E402
from kvtier.integrations import hf, hf_cache  # noqa: E402
from kvtier.integrations.models import ARCHITECTURES, ModelSpec, random_model  # noqa: E402
from kvtier.layout import KVLayout  # noqa: E402
from kvtier.policy.hints import output_class  # noqa: E402
from kvtier.store import TieredStore  # noqa: E402
from kvtier.tiers.host import HostTier  # noqa: E402
from kvtier.tiers.nvme import NVMeTier  # noqa: E402
from kvtier.tiers.nvme_index import SLOTS_FILE, slot_bytes_for  # noqa: E402

BT = 16
NEW = 6


def ident(model: Any) -> Identity:
    return hf_cache.model_identity(model, "random-llama")


@pytest.fixture(scope="module")
def model() -> Any:
    return random_model(ModelSpec(arch="llama", seed=1))


def prompt(n: int, seed: int) -> np.ndarray[Any, Any]:
    return np.random.default_rng(seed).integers(0, 1024, n).astype(np.int64)


def host_store(model: Any) -> TieredStore:
    layout = hf_cache.model_layout(model, BT)
    return TieredStore(layout, [HostTier(layout, 64 * layout.block_bytes)], identity=ident(model))


def nvme_store(model: Any, path: Path) -> TieredStore:
    layout = hf_cache.model_layout(model, BT)
    return TieredStore(
        layout,
        [NVMeTier(layout, [path], 64 * layout.block_bytes, workers=2)],
        identity=ident(model),
    )


def assert_same(got: hf.Generation, ref: hf.Generation) -> None:
    assert got.tokens == ref.tokens
    assert torch.equal(got.logits, ref.logits), (got.logits - ref.logits).abs().max()


def test_cache_round_trip_each_architecture() -> None:
    for arch in ARCHITECTURES:
        m = random_model(ModelSpec(arch=arch, layers=2, hidden=64, heads=4, kv_heads=2))
        cache = hf_cache.new_cache(m)
        with torch.inference_mode():
            m(torch.tensor([list(range(40))]), **hf_cache.cache_arg(m, cache), use_cache=True)
        kv = hf_cache.kv_from_cache(cache, 0, 40)
        assert kv.shape == (2, 2, 40, 2, 16)
        back = hf_cache.cache_from_kv(m, kv, 32)
        for a, b in zip(cache.layers, back.layers, strict=True):
            assert torch.equal(a.keys[:, :, :32], b.keys)
            assert torch.equal(a.values[:, :, :32], b.values)
        assert torch.equal(hf_cache.kv_from_cache(back, 16, 32), kv[:, :, 16:32])


def test_layout_mismatch_is_rejected_at_setup(model: Any) -> None:
    wrong = KVLayout(layers=4, kv_heads=4, head_dim=32, dtype="float32", block_tokens=BT)
    store = TieredStore(wrong, [HostTier(wrong, 8 * wrong.block_bytes)], identity=ident(model))
    with store, pytest.raises(LayoutError, match="kv_heads: model 2 vs store 4"):
        hf.generate_with_cache(model, store, prompt(40, 0), 2)


def test_input_ids_are_converted_or_rejected(model: Any) -> None:
    ids, toks = hf.input_tensor(model, torch.tensor([[5, 6, 7]], dtype=torch.int32))
    assert ids.dtype == torch.int64 and ids.shape == (1, 3) and list(toks) == [5, 6, 7]
    with pytest.raises(TokenError, match="integer"):
        hf.input_tensor(model, torch.tensor([[1.0, 2.0]]))
    with pytest.raises(TokenError, match="batch of 2"):
        hf.input_tensor(model, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(TokenError, match="vocabulary"):
        hf.input_tensor(model, [1, 5000])
    with pytest.raises(TokenError, match="empty"):
        hf.input_tensor(model, [])


def test_reference_matches_transformers_generate(model: Any) -> None:
    ids = prompt(37, 3)
    ref = hf.generate_reference(model, ids, NEW)
    out = model.generate(
        torch.from_numpy(ids)[None],
        max_new_tokens=NEW,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    assert out.sequences[0, len(ids) :].tolist() == ref.tokens
    assert torch.equal(torch.stack([x[0] for x in out.logits]), ref.logits)


def record_hints(store: TieredStore) -> set[object]:
    """The reuse classes the store will give its first-tier policy from now on (the policy
    ignores them; the store must still pass what the caller labelled)."""
    pol = store._index.policies[0]
    assert pol is not None
    seen: set[object] = set()
    insert = pol.insert

    def recording(keys: Any, hint: Any = None) -> None:
        seen.add(hint)
        insert(keys, hint)

    pol.insert = recording  # type: ignore[method-assign]
    return seen


def test_multi_turn_from_host_is_bit_identical(model: Any) -> None:
    with host_store(model) as store:
        hints = record_hints(store)
        turn1 = prompt(75, 4)
        got1 = hf.generate_with_cache(model, store, turn1, NEW)
        assert got1.n_reused == 0
        assert_same(got1, hf.generate_reference(model, turn1, NEW))
        # the next turn: the whole conversation so far plus a new user message
        turn2 = np.concatenate([turn1, got1.tokens, prompt(30, 5)])
        got2 = hf.generate_with_cache(model, store, turn2, NEW, reuse_class="chat")
        assert got2.n_reused == 80  # 5 blocks: the prompt's 4 and one holding generated tokens
        assert "chat" in hints
        assert set(got2.sources) == {"host"}
        assert_same(got2, hf.generate_reference(model, turn2, NEW))


def test_by_output_labels_the_prompt_by_how_the_request_went(model: Any) -> None:
    """``BY_OUTPUT``: the prompt is stored after decoding, labelled with the simulator's class
    (output length, reused a prefix); the output and what the next turn reuses are unchanged."""
    turn1 = prompt(75, 8)
    with host_store(model) as store:
        hints = record_hints(store)
        got1 = hf.generate_with_cache(model, store, turn1, NEW, reuse_class=hf.BY_OUTPUT)
        assert got1.stored_tokens == 64 + 16  # the prompt's 4 blocks, then the one it ends in
        assert_same(got1, hf.generate_reference(model, turn1, NEW))
        turn2 = np.concatenate([turn1, got1.tokens, prompt(30, 9)])
        got2 = hf.generate_with_cache(model, store, turn2, NEW, reuse_class=hf.BY_OUTPUT)
        assert got2.n_reused == 80
        assert_same(got2, hf.generate_reference(model, turn2, NEW))
        assert output_class(NEW, False) in hints and output_class(NEW, True) in hints
        assert hf.BY_OUTPUT not in hints


def test_fully_cached_prompt_still_recomputes_the_tail(model: Any) -> None:
    ids = prompt(64, 6)  # ends on a block boundary
    with host_store(model) as store:
        hf.generate_with_cache(model, store, ids, 1)
        assert store.lookup(ids) == 64
        got = hf.generate_with_cache(model, store, ids, NEW)
    assert got.n_cached == 64 and got.n_reused == 64 - hf.MIN_RECOMPUTE
    assert_same(got, hf.generate_reference(model, ids, NEW))


def test_nvme_restart_and_corruption(model: Any, tmp_path: Path) -> None:
    ids = prompt(100, 7)
    ref = hf.generate_reference(model, ids, NEW)
    with nvme_store(model, tmp_path) as store:
        hf.generate_with_cache(model, store, ids[:90], 1)
        got = hf.generate_with_cache(model, store, ids, NEW)
        assert got.n_reused == 80 and set(got.sources) == {"nvme"}
        assert_same(got, ref)
    with nvme_store(model, tmp_path) as store:  # a new process's store over the same directory
        assert store.lookup(ids) == 96
        got = hf.generate_with_cache(model, store, ids, NEW, store_generated="none")
        assert got.n_reused == 84 and set(got.sources) == {"nvme"}
        assert_same(got, ref)
    layout = hf_cache.model_layout(model, BT)
    slot = slot_bytes_for(layout.block_bytes)
    with open(tmp_path / SLOTS_FILE, "r+b") as f:  # flip payload bytes of every stored slot
        for i in range(8):
            f.seek(i * slot + 64 + 100)
            f.write(b"\xff\x7f\x00\x01")
    with nvme_store(model, tmp_path) as store:
        got = hf.generate_with_cache(model, store, ids, NEW, store_generated="none")
        assert got.n_reused < 84
        assert_same(got, ref)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral"])
def test_other_architectures_are_bit_identical(arch: str) -> None:
    m = random_model(ModelSpec(arch=arch, layers=2, hidden=64, heads=4, kv_heads=2, seed=2))
    ids = prompt(70, 8)
    with host_store(m) as store:
        hf.generate_with_cache(m, store, ids[:50], 1)
        got = hf.generate_with_cache(m, store, ids, 4)
    assert got.n_reused == 48
    assert_same(got, hf.generate_reference(m, ids, 4))


def test_stock_sdpa_reuses_the_prefix_within_rounding() -> None:
    m = random_model(ModelSpec(seed=3), attn="sdpa")
    ids = prompt(90, 9)
    with host_store(m) as store:
        hf.generate_with_cache(m, store, ids[:70], 1)
        got = hf.generate_with_cache(m, store, ids, 3)
    ref = hf.generate_reference(m, ids, 3)
    assert got.n_reused == 64
    assert torch.allclose(got.logits, ref.logits, rtol=0, atol=1e-5)


@pytest.mark.gpu
def test_cuda_path_matches_reference() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    m = random_model(ModelSpec(seed=4), device="cuda")
    ids = torch.from_numpy(prompt(120, 10))  # on the CPU: converted to the model's device
    with host_store(m) as store:
        first = hf.generate_with_cache(m, store, ids[:100], 1)
        assert first.n_reused == 0
        got = hf.generate_with_cache(m, store, ids, NEW)
    ref = hf.generate_reference(m, ids.cuda(), NEW)
    assert got.n_reused == 96
    # CUDA kernels are not length-invariant: compare the first step within rounding
    assert got.tokens[0] == ref.tokens[0]
    assert torch.allclose(got.logits[0], ref.logits[0], rtol=0, atol=1e-4)


def test_demo_sessions_are_identical_and_hit_both_tiers(tmp_path: Path) -> None:
    import argparse

    from rich.console import Console

    from kvtier.cli import demo

    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args(
        [
            "--dir",
            str(tmp_path / "nvme"),
            "--sessions",
            "2",
            "--turns",
            "2",
            "--new-tokens",
            "2",
            "--host-blocks",
            "6",
            "--doc-tokens",
            "300",
        ]
    )
    console = Console(record=True, width=200)
    assert demo.demo_model.run(console, args) == 0
    text = console.export_text()
    assert "nvmex" in text and "hostx" in text and "identical" in text


@pytest.mark.slow
def test_bench_ttft_smoke(tmp_path: Path) -> None:
    import argparse

    from kvtier.bench import ttft

    parser = argparse.ArgumentParser()
    ttft.add_arguments(parser)
    res = ttft.run(parser.parse_args(["--lengths", "512", "--repeat", "1", "--dir", str(tmp_path)]))
    assert res["identical"] is True
    assert res["reused_nvme_tokens@512"] == 512


def test_exact_attention_is_length_invariant_across_chunks() -> None:
    from kvtier.integrations.exact_attention import exact_attention

    gen = torch.Generator().manual_seed(0)
    t, d = 600, 16  # crosses the 256-key and 512-query chunk boundaries
    q = torch.randn(1, 4, t, d, generator=gen)
    k = torch.randn(1, 2, t, d, generator=gen)
    v = torch.randn(1, 2, t, d, generator=gen)
    mod = torch.nn.Identity()
    full, _ = exact_attention(mod, q, k, v, None, scaling=d**-0.5)  # [1, t, heads, d]
    # numerically ordinary causal attention
    kr, vr = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    mask = torch.full((t, t), -torch.inf).triu(1)
    ref = torch.softmax(q @ kr.transpose(2, 3) * d**-0.5 + mask, -1) @ vr
    assert torch.allclose(full, ref.transpose(1, 2), atol=1e-5)
    # bitwise: a shorter pass (earlier request) and a suffix pass (cached prefix) agree
    for n in (257, 300, 513, 530):
        part, _ = exact_attention(mod, q[:, :, :n], k[:, :, :n], v[:, :, :n], None, scaling=d**-0.5)
        assert torch.equal(part, full[:, :n]), n
    for s in (100, 256, 520, 584):
        part, _ = exact_attention(mod, q[:, :, s:], k, v, None, scaling=d**-0.5)
        assert torch.equal(part, full[:, s:]), s


# --- refusing what would be silently wrong ---


def test_exact_attention_refuses_masks_it_would_ignore(model: Any) -> None:
    """A padding mask, a packed-sequence mask or a non-causal 4-D mask is an error for the
    ``kvtier_exact`` kernel (causal by position), never silently dropped; no mask, an all-ones
    mask and the causal 4-D mask give the plain result."""
    ids = torch.from_numpy(prompt(40, 11))[None]
    kw: dict[str, Any] = {"max_new_tokens": 3, "do_sample": False, "pad_token_id": 0}
    with torch.inference_mode():
        plain = model.generate(ids, **kw)
        assert torch.equal(model.generate(ids, attention_mask=torch.ones_like(ids), **kw), plain)
        padded = torch.cat([torch.zeros(1, 5, dtype=torch.long), ids], dim=1)
        mask = torch.cat([torch.zeros(1, 5, dtype=torch.long), torch.ones_like(ids)], dim=1)
        with pytest.raises(ConfigError, match=r"attention_mask masks 5 of 45 positions.*sdpa"):
            model.generate(padded, attention_mask=mask, **kw)
        causal = torch.ones(40, 40, dtype=torch.bool).tril()[None, None]
        assert torch.equal(model(ids, attention_mask=causal).logits, model(ids).logits)
        with pytest.raises(ConfigError, match="not the causal mask"):
            model(ids, attention_mask=torch.ones(1, 1, 40, 40, dtype=torch.bool))
        packed = torch.cat([torch.arange(20), torch.arange(20)])[None]  # two sequences in one row
        with pytest.raises(ConfigError, match="other than causal"):
            model(ids, position_ids=packed, use_cache=False)


def test_generate_with_cache_refuses_options_it_does_not_implement(model: Any) -> None:
    ids = prompt(40, 12)
    with host_store(model) as store:
        for bad in ({"do_sample": True}, {"temperature": 0.7}, {"num_beams": 2}):
            name = next(iter(bad))
            with pytest.raises(ConfigError, match=rf"greedily.*unsupported: {name}=.*it takes"):
                hf.generate_with_cache(model, store, ids, 2, **bad)
        with pytest.raises(ConfigError, match="attention_mask masks 3 of 40 positions"):
            mask = torch.ones(1, 40, dtype=torch.long)
            mask[0, :3] = 0
            hf.generate_with_cache(model, store, ids, 2, attention_mask=mask)
        with pytest.raises(ConfigError, match="attention_mask has shape"):
            hf.generate_with_cache(model, store, ids, 2, attention_mask=torch.ones(1, 39))
        for n in (True, False, 0, -1, 2.0, "3"):
            with pytest.raises(ConfigError, match="max_new_tokens must be a positive integer"):
                hf.generate_with_cache(model, store, ids, n)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="eos_token_id"):
            hf.generate_with_cache(model, store, ids, 2, eos_token_id="2")  # type: ignore[arg-type]
        assert store.lookup(ids) == 0  # nothing was stored by a refused call
        # what is accepted: a tokenizer's all-ones mask, do_sample=False, several eos ids
        ref = hf.generate_reference(model, ids, 6)
        got = hf.generate_with_cache(
            model, store, ids, 6, attention_mask=np.ones((1, 40)), do_sample=False
        )
        assert_same(got, ref)
        eos = ref.tokens[-1]
        stop = hf.generate_with_cache(model, store, ids, 6, eos_token_id=[5000, eos])
        assert stop.tokens == ref.tokens[: ref.tokens.index(eos) + 1]


def test_bad_token_ids_are_named_with_their_position(model: Any) -> None:
    ids = prompt(40, 13).tolist()
    with host_store(model) as store:
        with pytest.raises(TokenError, match="non-negative, found -1 at position 30"):
            hf.generate_with_cache(model, store, [*ids[:30], -1, *ids[30:]], 2)
        with pytest.raises(TokenError, match="non-negative, found -7 at position 2"):
            hf.generate_with_cache(model, store, torch.tensor([[1, 2, -7, 3]]), 2)
        with pytest.raises(TokenError, match="token id 1024 at position 40 is outside"):
            hf.generate_with_cache(model, store, [*ids, 1024, 3], 2)
        with pytest.raises(TokenError, match=r"1-D \(one sequence\), got shape \(2, 40\)"):
            hf.generate_with_cache(model, store, [ids, ids], 2)


def test_readme_hf_example_runs() -> None:
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme.split("### HuggingFace transformers", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(code, "README.md", "exec"), {})


def test_a_store_for_another_model_configuration_is_refused(model: Any) -> None:
    """Two configurations that compute different KV (here: another RoPE base) never share a
    block: the fingerprint differs, and a store built for one refuses the other."""
    import copy

    other = copy.deepcopy(model)
    other.config.rope_theta = 1234.5
    other.config.rope_parameters = {"rope_type": "default", "rope_theta": 1234.5}
    assert hf_cache.model_fingerprint(other) != hf_cache.model_fingerprint(model)
    eager = copy.deepcopy(model)
    eager.config._attn_implementation = "eager"
    assert hf_cache.model_fingerprint(eager) != hf_cache.model_fingerprint(model)
    with host_store(model) as store:
        with pytest.raises(ConfigError, match="model fingerprint"):
            hf.generate_with_cache(other, store, prompt(40, 0), 1)
        assert store.stats()["store"]["stored_tokens"] == 0
    layout = hf_cache.model_layout(model, BT)
    bare = TieredStore(layout, [HostTier(layout, 8 * layout.block_bytes)], model_id="m")
    with bare, pytest.raises(ConfigError, match="model_identity"):
        hf.generate_with_cache(model, bare, prompt(40, 0), 1)  # no fingerprint at all
