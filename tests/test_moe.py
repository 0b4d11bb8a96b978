"""Qwen3-MoE (models/moe.py): logit parity with transformers' `Qwen3MoeForCausalLM`, the KV-cache path, HF export,
expert parallelism on 8 fake CPU devices, the router-replay hook, and the LoRA refusal."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from transformers import AutoModelForCausalLM

from asyncrl.models import Model, from_pretrained, moe, preset, save_pretrained
from asyncrl.models.config import ModelConfig, ModelConfigError
from asyncrl.sharding.rules import fsdp_rules, tensor_parallel_rules
from tests.helpers import hf_logits, max_valid_err, ragged_batch, random_params, save_hf_model

LENS = [21, 13, 6, 17]
MOE_KINDS = ("qwen3_moe", "qwen3_moe_nonorm")  # norm_topk_prob true / false; 6 experts, top-3, layer 1 dense


@pytest.fixture(scope="module", params=MOE_KINDS)
def hf_pair(request, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp(request.param))
    hf = save_hf_model(request.param, folder)
    model, params = from_pretrained(folder)
    return request.param, folder, hf, model, params


def test_config_and_layout(hf_pair):
    kind, folder, _, model, params = hf_pair
    c = model.cfg
    assert (c.family, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == ("qwen3_moe", 6, 3, 32)
    assert c.norm_topk_prob == (kind == "qwen3_moe")
    assert c.sparse_layers == (0, 2) and c.dense_layers == (1,)
    assert params.layers.moe.w_gate.shape == (2, 6, 64, 32) and params.layers.moe.router.shape == (2, 64, 6)
    assert params.layers.w_gate is None and params.dense_layers.w_gate.shape == (1, 64, 96)
    # What transformers 5.24 writes: one tensor per expert and projection, the router as `mlp.gate`.
    from safetensors import safe_open

    names = set(safe_open(os.path.join(folder, "model.safetensors"), "np").keys())
    assert "model.layers.2.mlp.experts.5.down_proj.weight" in names and "model.layers.0.mlp.gate.weight" in names
    assert "model.layers.1.mlp.gate_proj.weight" in names and "model.layers.1.mlp.gate.weight" not in names


def test_logit_parity_right_padded(hf_pair):
    kind, _, hf, model, params = hf_pair
    toks, lens = ragged_batch(model.cfg.vocab_size, LENS, width=24)
    ref = hf_logits(hf, toks, lens)
    ours, _ = jax.jit(model.apply)(params, jnp.asarray(toks), jnp.asarray(lens))
    err = max_valid_err(np.asarray(ours), ref, lens)
    print(f"{kind}: max |ours - transformers| = {err:.2e}")
    assert err <= 1e-4, kind
    assert float(np.std(ref[0, : LENS[0]])) > 0.1


def test_routing_uses_every_expert_and_differs_by_token(hf_pair):
    """The parity above is not of a degenerate router: tokens spread over all experts."""
    _, _, _, model, params = hf_pair
    toks, _ = ragged_batch(model.cfg.vocab_size, [24] * 4)
    x = jnp.take(params.embed, jnp.asarray(toks), axis=0)
    layer = jax.tree.map(lambda w: w[0], params.layers.moe)
    _, ids = moe.moe_mlp(x, layer, model.cfg)
    assert ids.shape == (4, 24, 3)
    assert set(np.asarray(ids).ravel().tolist()) == set(range(6))
    assert all(len(set(row)) == 3 for row in np.asarray(ids).reshape(-1, 3).tolist())  # k distinct experts


def test_prefill_then_decode_matches_full_forward(hf_pair):
    kind, _, _, model, params = hf_pair
    n_decode = 6
    prompt_lens = np.array([9, 4, 12, 7], np.int32)
    full_lens = prompt_lens + n_decode
    toks, _ = ragged_batch(model.cfg.vocab_size, full_lens, width=int(full_lens.max()), seed=3)
    full, _ = jax.jit(model.apply)(params, jnp.asarray(toks), jnp.asarray(full_lens))
    full = np.asarray(full)
    width = 16
    prompt = np.where(np.arange(width)[None, :] < prompt_lens[:, None], toks[:, :width], 0)
    cache = model.init_kv_cache(len(prompt_lens), 32, jnp.float32)
    prefill = jax.jit(model.prefill, static_argnames="apply_lm_head")
    logits, cache = prefill(params, jnp.asarray(prompt), jnp.asarray(prompt_lens), cache, apply_lm_head=True)
    for i, n in enumerate(prompt_lens):
        np.testing.assert_allclose(np.asarray(logits)[i, :n], full[i, :n], atol=1e-4, err_msg=kind)
    step = jax.jit(model.apply)
    rows = np.arange(len(prompt_lens))
    worst = 0.0
    for t in range(n_decode):
        nxt = toks[rows, prompt_lens + t][:, None]
        logits, cache = step(params, jnp.asarray(nxt), jnp.ones(len(rows), jnp.int32), cache)
        err = float(np.abs(np.asarray(logits)[:, 0] - full[rows, prompt_lens + t]).max())
        worst = max(worst, err)
        assert err <= 1e-4, f"{kind} step {t}"
    print(f"{kind}: decode max |cached - full| = {worst:.2e}")
    np.testing.assert_array_equal(np.asarray(cache.length), full_lens)


def test_round_trip_through_transformers(hf_pair, tmp_path):
    kind, _, hf, model, params = hf_pair
    out = str(tmp_path / "saved")
    save_pretrained(model, params, out)
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"] and cfg["num_experts"] == 6
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded).__name__ == "Qwen3MoeForCausalLM"
    toks, lens = ragged_batch(model.cfg.vocab_size, LENS, seed=5)
    err = max_valid_err(hf_logits(hf, toks, lens), hf_logits(reloaded, toks, lens), lens)
    print(f"{kind}: export max |reloaded - original| = {err:.2e}")
    assert err <= 1e-5, kind
    model2, params2 = from_pretrained(out)
    assert model2.cfg == model.cfg
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_load_balancing_loss_equals_transformers(hf_pair):
    """train.moe.aux_coef's loss (`moe.load_sums` per MoE layer, `moe.load_balancing_loss`) is transformers'
    `load_balancing_loss_func` over the same router logits, right padding masked (its attention_mask)."""
    import torch
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    kind, _, hf, model, params = hf_pair
    c = model.cfg
    toks, lens = ragged_batch(c.vocab_size, LENS, width=24)
    mask = np.arange(24)[None, :] < np.asarray(lens)[:, None]
    with torch.no_grad():
        out = hf(torch.as_tensor(toks, dtype=torch.long), attention_mask=torch.as_tensor(mask, dtype=torch.long),
                 output_router_logits=True)
    want = float(load_balancing_loss_func(out.router_logits, c.num_experts, c.num_experts_per_tok,
                                          torch.as_tensor(mask, dtype=torch.long)))
    _, _, (ids, sums) = model.apply_routed(params, jnp.asarray(toks), jnp.asarray(lens), load_mask=jnp.asarray(mask))
    got, load = moe.load_balancing_loss(sums, jnp.sum(jnp.asarray(mask)).astype(jnp.float32), c.num_experts_per_tok)
    print(f"{kind}: aux loss ours {float(got):.6f}, transformers {want:.6f}")
    assert abs(float(got) - want) <= 1e-5 and want > c.num_experts_per_tok  # above k: this router is not uniform
    np.testing.assert_allclose(float(jnp.sum(load)), 1.0, atol=1e-6)
    counts = np.bincount(np.asarray(ids)[mask].reshape(-1), minlength=c.num_experts)  # the load is the ids' share
    np.testing.assert_allclose(np.asarray(load), counts / counts.sum(), atol=1e-6)


def test_sharded_safetensors_load_on_expert_mesh(hf_pair, tmp_path):
    """A sharded export reads straight onto an expert-parallel layout: each device holds its own experts."""
    _, _, _, model, params = hf_pair
    out = str(tmp_path / "sharded")
    save_pretrained(model, params, out, max_shard_bytes=100_000)
    assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))
    mesh = jax.make_mesh((2, 2, 2), ("dp", "fsdp", "expert"), axis_types=(AxisType.Explicit,) * 3)
    _, p8 = from_pretrained(out, mesh=mesh, rules=fsdp_rules().replace(expert="expert"))
    wg = p8.layers.moe.w_gate  # [L, E, D, I]: E over expert, D over fsdp
    assert {s.data.shape for s in wg.addressable_shards} == {(2, 3, 32, 32)}
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(p8), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---- expert parallelism -------------------------------------------------------------------------------------

CFG = preset("tiny_moe")


def _loss(model):
    """Mean log-likelihood per scored token: gradients of a trainer's per-token-mean loss's size."""
    def f(params, toks, lens):
        return jnp.sum(model.get_logprobs(params, toks, lens)) / jnp.sum(lens - 1)
    return f


def _place(model, params, mesh):
    return jax.device_put(params, model.param_shardings(mesh))


@pytest.mark.parametrize("path", ["as_run", "grouped"])
@pytest.mark.parametrize("layout", ["dp_fsdp_expert", "expert_tp"])
def test_expert_parallel_matches_one_device(layout, path, monkeypatch):
    """Forward and gradients under expert parallelism on 8 fake CPU devices equal one device's. `grouped`: every
    call through the grouped matmuls with each shard's expert offset (a shard's few tokens would otherwise take the
    decode-sized dense path, `moe.DENSE_MAX_TOKENS`)."""
    assert jax.device_count() == 8
    if path == "grouped":
        monkeypatch.setattr(moe, "DENSE_MAX_TOKENS", 0)
    params = jax.tree.map(jnp.asarray, random_params(CFG, seed=1))
    toks, lens = ragged_batch(CFG.vocab_size, [16, 9, 3, 12, 8, 16, 1, 5], seed=2)
    one = Model(CFG)
    ref_logits, _ = jax.jit(one.apply)(params, jnp.asarray(toks), jnp.asarray(lens))
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(_loss(one)))(params, jnp.asarray(toks), jnp.asarray(lens))
    if layout == "dp_fsdp_expert":  # the trainer's layout plus experts
        mesh = jax.make_mesh((2, 2, 2), ("dp", "fsdp", "expert"), axis_types=(AxisType.Explicit,) * 3)
        rules = fsdp_rules().replace(expert="expert")
    else:  # the inference replicas' tensor parallelism plus experts
        mesh = jax.make_mesh((2, 2, 2), ("dp", "expert", "tp"), axis_types=(AxisType.Explicit,) * 3)
        rules = tensor_parallel_rules(data_axis="dp").replace(expert="expert")
    model = Model(CFG, rules)
    sharded = _place(model, params, mesh)
    wg = sharded.layers.moe.w_gate  # [L, E, D, I]
    shard_shape = {"dp_fsdp_expert": (2, 2, 32, 48), "expert_tp": (2, 2, 64, 24)}[layout]
    assert {s.data.shape for s in wg.addressable_shards} == {shard_shape}  # really split, never a no-op
    with jax.set_mesh(mesh):
        logits, _ = jax.jit(model.apply)(sharded, jnp.asarray(toks), jnp.asarray(lens))
        loss, grads = jax.jit(jax.value_and_grad(_loss(model)))(sharded, jnp.asarray(toks), jnp.asarray(lens))
    assert grads.layers.moe.w_gate.sharding.spec == wg.sharding.spec
    err = max(float(np.abs(np.asarray(logits)[i, :n] - np.asarray(ref_logits)[i, :n]).max())
              for i, n in enumerate(lens))
    gerr = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
               for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True))
    print(f"{layout}: logits max diff {err:.2e}, grads max diff {gerr:.2e}")
    assert err <= 1e-5 and gerr <= 1e-5 and abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    assert float(np.abs(np.asarray(ref_grads.layers.moe.router)).max()) > 1e-3  # the router learns


# ---- router replay hook -------------------------------------------------------------------------------------

def test_replay_routes_to_the_given_experts_with_the_routers_own_weights():
    params = jax.tree.map(jnp.asarray, random_params(CFG, seed=3))
    layer = jax.tree.map(lambda w: w[0], params.layers.moe)
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 8, CFG.hidden_size))
    y, ids = moe.moe_mlp(x, layer, CFG)
    y2, ids2 = moe.moe_mlp(x, layer, CFG, expert_ids=ids)  # replaying its own choice changes nothing
    np.testing.assert_array_equal(np.asarray(ids2), np.asarray(ids))
    np.testing.assert_allclose(np.asarray(y2), np.asarray(y), atol=1e-6)
    # A perturbed router routes differently; replaying the recorded ids restores the routing, with weights from
    # the perturbed router's own probabilities at those ids.
    perturbed = moe.MoeParams(layer.router + 0.5 * jax.random.normal(jax.random.PRNGKey(1), layer.router.shape),
                              layer.w_gate, layer.w_up, layer.w_down)
    _, ids_p = moe.moe_mlp(x, perturbed, CFG)
    assert np.any(np.sort(np.asarray(ids_p), -1) != np.sort(np.asarray(ids), -1))
    y_r, ids_r = moe.moe_mlp(x, perturbed, CFG, expert_ids=ids)
    np.testing.assert_array_equal(np.asarray(ids_r), np.asarray(ids))
    xf = x.reshape(-1, CFG.hidden_size)
    w, _ = moe.route(xf, perturbed.router, CFG, ids.reshape(-1, 2))
    probs = jax.nn.softmax(xf @ perturbed.router, axis=-1)
    expect = np.take_along_axis(np.asarray(probs), np.asarray(ids).reshape(-1, 2), -1)
    np.testing.assert_allclose(np.asarray(w), expect / expect.sum(-1, keepdims=True), atol=1e-6)
    np.testing.assert_allclose(np.asarray(y_r).reshape(-1, CFG.hidden_size),
                               np.asarray(moe.experts(xf, ids.reshape(-1, 2), w, *([layer.w_gate, layer.w_up,
                                                                                    layer.w_down]))), atol=1e-6)
    # The router still gets a gradient under replay.
    g = jax.grad(lambda r: jnp.sum(moe.moe_mlp(x, moe.MoeParams(r, layer.w_gate, layer.w_up, layer.w_down), CFG,
                                               expert_ids=ids)[0] ** 2))(perturbed.router)
    assert float(jnp.abs(g).max()) > 0


# ---- config --------------------------------------------------------------------------------------------------

def test_bad_moe_configs_name_the_field():
    base = dict(family="qwen3_moe", num_layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
    ModelConfig(**base)
    for key, value in [("num_experts_per_tok", 5), ("moe_intermediate_size", 0), ("mlp_only_layers", (2,)),
                       ("decoder_sparse_step", 0)]:
        with pytest.raises(ModelConfigError, match=f"model.{key}="):
            ModelConfig(**{**base, key: value})
    with pytest.raises(ModelConfigError, match="no mixture-of-experts layer"):
        ModelConfig(**{**base, "mlp_only_layers": (0, 1)})
    with pytest.raises(ModelConfigError, match="model.num_experts=4 needs model.family='qwen3_moe'"):
        ModelConfig(family="qwen3", num_experts=4)


def test_lora_on_moe_is_refused():
    from asyncrl.train.config import LoraConfig, ShardingConfig, TrainConfig
    from asyncrl.train.loss_config import LossConfig
    from asyncrl.train.trainer import Trainer
    from asyncrl.validate import ConfigError

    train = TrainConfig(train_batch_size=8, lora=LoraConfig(rank=4))
    with pytest.raises(ConfigError, match=r"train\.lora\.rank=4 .*mixture-of-experts.*model\.num_experts=4"):
        Trainer(Model(CFG), train, LossConfig(name="grpo"), ShardingConfig(), devices=jax.devices()[:1])


def test_route_records_take_one_byte_up_to_128_experts():
    """Ids 0..127 and -1 ("route freely") fit int8: Qwen3-30B-A3B's 128 experts record 48 x 8 x 1 = 384 bytes a
    token; past 128 experts the record is int16."""
    from types import SimpleNamespace

    assert moe.route_dtype(SimpleNamespace(num_experts=128)) == jnp.int8
    assert moe.route_dtype(SimpleNamespace(num_experts=129)) == jnp.int16
    c = preset("qwen3-30b-a3b")
    per_token = len(c.sparse_layers) * c.num_experts_per_tok * jnp.dtype(moe.route_dtype(c)).itemsize
    assert c.num_experts == 128 and per_token == 384
