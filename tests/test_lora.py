"""LoRA (models/lora.py): the adapted forward, its gradients, merging, and PEFT's format against `peft` itself."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncrl.models import from_pretrained, lora
from tests.helpers import KINDS, hf_logits, ragged_batch, save_hf_model

LENS = [11, 7, 16, 4]
ALL = tuple(lora.TARGETS)


def _random_adapters(cfg, rank, targets, seed=1, b_scale=0.05):
    """Adapters with a nonzero B (a trained-looking adapter): B's init is zero, which would test nothing."""
    ad = lora.init(cfg, rank, targets, jax.random.key(seed))
    key = jax.random.key(seed + 100)
    out = {}
    for f, pair in ad.items():
        key, k = jax.random.split(key)
        out[f] = {"a": pair["a"], "b": b_scale * jax.random.normal(k, pair["b"].shape, jnp.float32)}
    return out


@pytest.fixture(scope="module", params=KINDS)
def pair(request, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp(request.param))
    hf = save_hf_model(request.param, folder)
    model, params = from_pretrained(folder)
    return request.param, folder, hf, model, params


def test_zero_b_gives_the_base_logits_exactly(pair):
    _, _, _, model, params = pair
    toks, lens = ragged_batch(model.cfg.vocab_size, LENS)
    ad = lora.init(model.cfg, 8, ALL, jax.random.key(0))
    assert all(float(jnp.abs(p["a"]).max()) > 0 and float(jnp.abs(p["b"]).max()) == 0 for p in ad.values())
    base, _ = jax.jit(model.apply)(params, jnp.asarray(toks), jnp.asarray(lens))
    adapted, _ = jax.jit(model.apply)(lora.attach(params, ad, 2.0), jnp.asarray(toks), jnp.asarray(lens))
    np.testing.assert_array_equal(np.asarray(adapted), np.asarray(base))


@pytest.mark.parametrize("targets", [ALL, ("q", "v"), ("o", "down")])
def test_merged_weights_give_the_unmerged_logits(pair, targets):
    _, _, _, model, params = pair
    toks, lens = ragged_batch(model.cfg.vocab_size, LENS, seed=2)
    ad = _random_adapters(model.cfg, 4, targets)
    unmerged, _ = jax.jit(model.apply)(lora.attach(params, ad, 4.0), jnp.asarray(toks), jnp.asarray(lens))
    merged, _ = jax.jit(model.apply)(lora.merge(params, ad, 4.0), jnp.asarray(toks), jnp.asarray(lens))
    base, _ = jax.jit(model.apply)(params, jnp.asarray(toks), jnp.asarray(lens))
    valid = np.arange(toks.shape[1])[None, :] < np.asarray(lens)[:, None]
    err = np.abs(np.asarray(unmerged) - np.asarray(merged))[valid].max()
    assert err <= 1e-5, err
    # The adapters matter: far more than the tolerance.
    assert np.abs(np.asarray(unmerged) - np.asarray(base))[valid].max() > 1e-2


def test_gradients_match_finite_differences():
    from asyncrl.models import Model, preset

    model = Model(preset("tiny"))
    params = model.init_params(jax.random.key(0))
    ad = _random_adapters(model.cfg, 4, ALL, b_scale=0.1)
    toks, lens = ragged_batch(model.cfg.vocab_size, [9, 6], seed=5)
    toks, lens = jnp.asarray(toks), jnp.asarray(lens)

    def loss(a):
        return -jnp.sum(model.get_logprobs(lora.attach(params, a, 2.0), toks, lens))

    g = jax.jit(jax.grad(loss))(ad)
    rng = np.random.default_rng(0)
    for f in ("wq", "wo", "w_down"):
        for side in ("a", "b"):
            direction = jax.tree.map(jnp.zeros_like, ad)
            d = rng.standard_normal(ad[f][side].shape).astype(np.float32)
            direction[f][side] = jnp.asarray(d / np.linalg.norm(d))
            eps = 1e-2
            plus = jax.tree.map(lambda x, v: x + eps * v, ad, direction)
            minus = jax.tree.map(lambda x, v: x - eps * v, ad, direction)
            fd = (float(loss(plus)) - float(loss(minus))) / (2 * eps)
            analytic = float(jnp.sum(g[f][side] * direction[f][side]))
            assert abs(fd - analytic) <= 2e-2 * max(1.0, abs(analytic)), (f, side, fd, analytic)
            assert abs(analytic) > 1e-3, (f, side)  # a direction the loss actually moves along


@pytest.mark.parametrize("targets", [ALL, ("q", "k", "v", "o")])
def test_peft_loads_the_exported_adapter_onto_the_transformers_model(pair, targets, tmp_path):
    from peft import PeftModel

    kind, folder, hf, model, params = pair
    rank, alpha = 4, 8.0
    ad = _random_adapters(model.cfg, rank, targets, seed=3)
    lora.save_peft(str(tmp_path / "adapter"), model.cfg, ad, rank, alpha, base_model=folder)
    toks, lens = ragged_batch(model.cfg.vocab_size, LENS, seed=4)
    ours, _ = jax.jit(model.apply)(lora.attach(params, ad, alpha / rank), jnp.asarray(toks), jnp.asarray(lens))
    base_hf = save_hf_model(kind, str(tmp_path / "base"))  # a fresh copy: PeftModel injects layers into it
    peft_model = PeftModel.from_pretrained(base_hf, str(tmp_path / "adapter")).eval()
    ref = hf_logits(peft_model, toks, lens)
    valid = np.arange(toks.shape[1])[None, :] < np.asarray(lens)[:, None]
    err = np.abs(np.asarray(ours) - ref)[valid].max()
    assert err <= 1e-4, (kind, err)
    assert np.abs(ref - hf_logits(hf, toks, lens))[valid].max() > 1e-2  # peft applied the adapter
    # And back: the folder reads into the same adapters, rank, alpha and targets.
    back = lora.load_peft_adapter(str(tmp_path / "adapter"), model.cfg)
    assert (back.rank, back.alpha, back.targets, back.scale) == (rank, alpha, tuple(targets), alpha / rank)
    for name in ad:
        for side in ("a", "b"):
            np.testing.assert_array_equal(back.adapters[name][side], np.asarray(ad[name][side]))


PEFT_KIND = "qwen3_untied"  # head_dim 24 != hidden / heads: the heads dims must unflatten in HF's order


@pytest.fixture(scope="module")
def peft_written(tmp_path_factory):
    """A tiny HF model and a LoRA adapter for it that `peft` itself writes (q, v, o and down; B made nonzero)."""
    import torch
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("peft")
    base = str(root / "base")
    hf = save_hf_model(PEFT_KIND, base)
    peft_model = get_peft_model(hf, LoraConfig(r=4, lora_alpha=12, target_modules=["q_proj", "v_proj", "o_proj",
                                                                                    "down_proj"]))
    torch.manual_seed(7)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn_like(p))
    peft_model.save_pretrained(str(root / "adapter"))
    return base, str(root / "adapter")


def _copy_adapter(src, dst, config=None, edit=None):
    """A copy of the adapter folder with `config` merged into its adapter_config.json and `edit` applied to its
    tensors (a dict of numpy arrays)."""
    import json
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    if config:
        with open(f"{dst}/adapter_config.json") as f:
            conf = json.load(f)
        with open(f"{dst}/adapter_config.json", "w") as f:
            json.dump({**conf, **config}, f)
    if edit:
        tensors = load_file(f"{dst}/adapter_model.safetensors")
        edit(tensors)
        save_file(tensors, f"{dst}/adapter_model.safetensors")
    return str(dst)


@pytest.mark.parametrize("rslora", [False, True])
def test_load_peft_adapter_reads_what_peft_writes(peft_written, rslora, tmp_path):
    """Rank, alpha and targets come from adapter_config.json; the adapted logits match peft's own model."""
    from peft import PeftModel

    from tests.helpers import make_hf_model

    base, adapter = peft_written
    if rslora:  # alpha / sqrt(r): the same tensors, another scale
        adapter = _copy_adapter(adapter, tmp_path / "rslora", config={"use_rslora": True})
    model, params = from_pretrained(base)
    got = lora.load_peft_adapter(adapter, model.cfg)
    assert (got.rank, got.alpha, got.targets) == (4, 12.0, ("q", "v", "o", "down"))
    assert got.scale == pytest.approx(12.0 / 2.0 if rslora else 12.0 / 4.0)
    assert sorted(got.adapters) == ["w_down", "wo", "wq", "wv"]
    toks, lens = ragged_batch(model.cfg.vocab_size, LENS, seed=6)
    ours, _ = jax.jit(model.apply)(lora.attach(params, got.adapters, got.scale), jnp.asarray(toks),
                                   jnp.asarray(lens))
    ref = hf_logits(PeftModel.from_pretrained(make_hf_model(PEFT_KIND), adapter).eval(), toks, lens)
    valid = np.arange(toks.shape[1])[None, :] < np.asarray(lens)[:, None]
    err = np.abs(np.asarray(ours) - ref)[valid].max()
    assert err <= 1e-4, err
    assert np.abs(ref - hf_logits(make_hf_model(PEFT_KIND), toks, lens))[valid].max() > 1e-2  # the adapter matters


Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


def _add(key, shape):
    return lambda t: t.__setitem__(key, np.zeros(shape, np.float32))


@pytest.mark.parametrize("config,edit,match", [
    # a module the config does not target (peft would ignore it; we refuse rather than drop a trained tensor)
    (None, _add("base_model.model.model.layers.1.mlp.up_proj.lora_A.weight", (4, 64)),
     r"outside the targets \['down', 'o', 'q', 'v'\]: \['base_model\.model\.model\.layers\.1\.mlp\.up_proj"),
    # names we cannot place: a DoRA magnitude, a layer past the model's, a module the model has not
    (None, _add("base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector", (96,)),
     r"unknown tensor names: \['base_model\.model\.model\.layers\.0\.self_attn\.q_proj\.lora_magnitude_vector'\]"),
    (None, _add("base_model.model.model.layers.2.self_attn.q_proj.lora_A.weight", (4, 64)),
     r"unknown tensor names: \['base_model\.model\.model\.layers\.2\.self_attn\.q_proj\.lora_A\.weight'\]"),
    (None, _add("base_model.model.model.layers.0.self_attn.qkv_proj.lora_A.weight", (4, 64)),
     r"unknown tensor names: .*qkv_proj"),
    # A stored transposed: as many values, the wrong shape
    (None, lambda t: t.__setitem__(Q_A, np.ascontiguousarray(t[Q_A].T)),
     r"wrong shape: \['base_model\.model\.model\.layers\.0\.self_attn\.q_proj\.lora_A\.weight \(64, 4\) "
     r"\(expected \(4, 64\)\)'\]"),
    (None, lambda t: t.pop("base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"),
     r"missing tensors: \['base_model\.model\.model\.layers\.1\.self_attn\.v_proj\.lora_B\.weight'\]"),
    # config options that change what the tensors mean, and targets we do not have
    ({"use_dora": True}, None, r"use_dora=True is not supported"),
    ({"rank_pattern": {"q_proj": 8}}, None, r"rank_pattern=\{'q_proj': 8\} is not supported"),
    ({"target_modules": ["q_proj", "c_attn"]}, None, r"target_modules=\['q_proj', 'c_attn'\] is not supported"),
    ({"target_modules": ["q_proj"]}, None, r"outside the targets \['q'\]"),
    ({"r": 0}, None, r"r=0 is invalid"),
])
def test_load_peft_adapter_refuses_what_it_cannot_place(peft_written, tmp_path, config, edit, match):
    base, adapter = peft_written
    from asyncrl.models.config import ModelConfig

    bad = _copy_adapter(adapter, tmp_path / "bad", config=config, edit=edit)
    with pytest.raises(ValueError, match=match):
        lora.load_peft_adapter(bad, ModelConfig.from_hf_folder(base))


@pytest.mark.parametrize("rank,split", [(32, True), (8, False)])
def test_adapters_under_fsdp_are_split_like_w_only_past_the_size_floor(rank, split):
    """The README's statement: under FSDP (D split, the 10 MB default floor) the factor holding D (A of q, k, v,
    gate, up; B of o, down) is split like W's when it is at least min_bytes_for_fsdp, else replicated, as is the
    other factor always. Qwen3-8B: 18.9 MB factors at rank 32, 4.7 MB at rank 8. Shardings only: nothing is
    allocated."""
    from jax.sharding import PartitionSpec as P

    from asyncrl.models import preset
    from asyncrl.train.config import MeshConfig, ShardingConfig
    from asyncrl.train.mesh import make_train_mesh, train_rules

    mesh = make_train_mesh(MeshConfig(dp=1, fsdp=8, cp_ulysses=1))
    cfg, sharding = preset("qwen3-8b"), ShardingConfig()
    assert sharding.min_bytes_for_fsdp == 10_000_000 and sharding.fsdp_axis == "embed"
    sh = lora.shardings(cfg, rank, ALL, mesh, train_rules(sharding))
    holds_d = {"wq": "a", "wk": "a", "wv": "a", "w_gate": "a", "w_up": "a", "wo": "b", "w_down": "b"}
    for f, side in holds_d.items():
        d_dim = 1 if side == "a" else 2
        want = [None] * len(sh[f][side].spec)
        if split:
            want[d_dim] = "fsdp"
        assert sh[f][side].spec == P(*want), (f, side, sh[f][side].spec)
        other = "b" if side == "a" else "a"
        assert all(x is None for x in sh[f][other].spec), (f, other)
    w = train_rules(sharding).spec(("layers", "embed", "heads", "head_dim"), nbytes=10**9)
    assert w == P(None, "fsdp", None, None)  # W itself: D split


def test_unknown_target_names_the_field():
    from asyncrl.models import preset

    with pytest.raises(ValueError, match="train.lora.targets.*'qq'"):
        lora.abstract(preset("tiny"), 4, ("q", "qq"))


def test_unmerged_adapters_under_tensor_parallelism_and_in_the_cpu_decode_layout():
    """The adapters' sharding rules on a dp x tp Explicit mesh (B split over heads / mlp like W's outputs, wo's and
    w_down's A over their split inputs, so those contractions are summed over tp), and the engine's CPU layout
    (output-major base, adapters as they are): both give the unsharded stacked forward's logits."""
    from jax.sharding import AxisType, Mesh, NamedSharding

    from asyncrl.models import Model, dense, preset
    from asyncrl.sharding.rules import tensor_parallel_rules

    cfg = preset("tiny")
    model = Model(cfg)
    params = model.init_params(jax.random.key(0))
    ad = _random_adapters(cfg, 4, ALL)
    x = jax.random.randint(jax.random.key(3), (4, 6), 0, cfg.vocab_size)
    lens = jnp.array([6, 3, 1, 5], jnp.int32)
    ref, _ = jax.jit(model.apply)(lora.attach(params, ad, 2.0), x, lens)

    layout = dense.cpu_decode_layout(lora.attach(params, ad, 2.0))
    assert dense.is_output_major(layout) and isinstance(layout.layers[0].wq, lora.LoraWeight)
    got, _ = jax.jit(model.apply)(layout, x, lens)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)

    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("dp", "tp"), axis_types=(AxisType.Explicit,) * 2)
    rules = tensor_parallel_rules("tp", "dp")
    tp_model = model.with_rules(rules)
    with jax.set_mesh(mesh):
        p = jax.device_put(params, model.with_rules(rules).param_shardings(mesh))
        a = jax.device_put(ad, lora.shardings(cfg, 4, ALL, mesh, rules))
        assert a["wq"]["b"].sharding.spec[2] == "tp" and a["wo"]["a"].sharding.spec[1] == "tp"
        assert a["w_down"]["a"].sharding.spec[1] == "tp" and a["w_up"]["b"].sharding.spec[2] == "tp"
        xs = jax.device_put(x, NamedSharding(mesh, jax.sharding.PartitionSpec("dp", None)))
        ls = jax.device_put(lens, NamedSharding(mesh, jax.sharding.PartitionSpec("dp")))
        got, _ = jax.jit(tp_model.apply)(lora.attach(p, a, 2.0), xs, ls)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-4, atol=1e-4)
