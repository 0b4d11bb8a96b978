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
    # And back: the PEFT tensors read into the same adapters.
    from asyncrl.models.safetensors_io import SafetensorsFile

    f = SafetensorsFile(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    back = lora.from_peft_tensors(model.cfg, {k: f.get(k) for k in f.keys()}, rank, targets)
    for name in ad:
        for side in ("a", "b"):
            np.testing.assert_array_equal(back[name][side], np.asarray(ad[name][side]))


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
