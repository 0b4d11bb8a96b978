"""Logit parity of our JAX decoder with transformers (PyTorch), KV-cache consistency, HF round trips."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl.models import from_pretrained, save_pretrained
from tests.helpers import KINDS, hf_logits, max_valid_err, ragged_batch, save_hf_model

LENS = [21, 13, 6, 17]


@pytest.fixture(scope="module", params=KINDS)
def hf_pair(request, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp(request.param))
    hf = save_hf_model(request.param, folder)
    model, params = from_pretrained(folder)
    return request.param, folder, hf, model, params


def test_logit_parity_right_padded(hf_pair):
    kind, _, hf, model, params = hf_pair
    toks, lens = ragged_batch(model.cfg.vocab_size, LENS, width=24)
    ref = hf_logits(hf, toks, lens)
    ours, cache = jax.jit(model.apply)(params, jnp.asarray(toks), jnp.asarray(lens))
    assert cache is None
    assert ours.shape == ref.shape
    assert max_valid_err(np.asarray(ours), ref, lens) <= 1e-4, kind
    # The comparison is meaningful: logits vary a lot across positions.
    assert float(np.std(ref[0, : LENS[0]])) > 0.1


def test_hidden_without_lm_head(hf_pair):
    _, _, _, model, params = hf_pair
    toks, lens = ragged_batch(model.cfg.vocab_size, LENS)
    h, _ = model.apply(params, jnp.asarray(toks), jnp.asarray(lens), apply_lm_head=False)
    assert h.shape == (len(LENS), toks.shape[1], model.cfg.hidden_size)
    logits, _ = model.apply(params, jnp.asarray(toks), jnp.asarray(lens))
    np.testing.assert_allclose(np.asarray(model.lm_head(params, h)), np.asarray(logits), atol=1e-5)


def test_prefill_then_decode_matches_full_forward(hf_pair):
    kind, _, _, model, params = hf_pair
    n_decode = 8
    prompt_lens = np.array([9, 4, 12, 7], np.int32)
    full_lens = prompt_lens + n_decode
    toks, _ = ragged_batch(model.cfg.vocab_size, full_lens, width=int(full_lens.max()), seed=3)
    full, _ = jax.jit(model.apply)(params, jnp.asarray(toks), jnp.asarray(full_lens))
    full = np.asarray(full)

    width = 16  # prompt bucket
    prompt = np.where(np.arange(width)[None, :] < prompt_lens[:, None], toks[:, :width], 0)
    cache = model.init_kv_cache(len(prompt_lens), 32, jnp.float32)
    logits, cache = jax.jit(model.apply)(params, jnp.asarray(prompt), jnp.asarray(prompt_lens), cache)
    logits = np.asarray(logits)
    for i, n in enumerate(prompt_lens):
        np.testing.assert_allclose(logits[i, :n], full[i, :n], atol=1e-4, err_msg=kind)
    step = jax.jit(model.apply)
    rows = np.arange(len(prompt_lens))
    for t in range(n_decode):
        nxt = toks[rows, prompt_lens + t][:, None]
        logits, cache = step(params, jnp.asarray(nxt), jnp.ones(len(rows), jnp.int32), cache)
        np.testing.assert_allclose(np.asarray(logits)[:, 0], full[rows, prompt_lens + t], atol=1e-4,
                                   err_msg=f"{kind} step {t}")
    np.testing.assert_array_equal(np.asarray(cache.length), full_lens)


def test_round_trip_through_transformers(hf_pair, tmp_path):
    kind, _, hf, model, params = hf_pair
    out = str(tmp_path / "saved")
    save_pretrained(model, params, out)
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    toks, lens = ragged_batch(model.cfg.vocab_size, LENS, seed=5)
    a, b = hf_logits(hf, toks, lens), hf_logits(reloaded, toks, lens)
    assert max_valid_err(a, b, lens) <= 1e-5, kind
    assert type(reloaded).__name__ == type(hf).__name__


def test_sharded_safetensors_with_index(hf_pair, tmp_path):
    kind, _, _, model, params = hf_pair
    out = str(tmp_path / "sharded")
    save_pretrained(model, params, out, max_shard_bytes=60_000)
    files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    assert len(files) >= 2 and os.path.exists(os.path.join(out, "model.safetensors.index.json"))
    _, params2 = from_pretrained(out)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # transformers reads the sharded layout too.
    hf2 = AutoModelForCausalLM.from_pretrained(out).eval()
    toks, lens = ragged_batch(model.cfg.vocab_size, LENS, seed=7)
    ours, _ = model.apply(params2, jnp.asarray(toks), jnp.asarray(lens))
    assert max_valid_err(np.asarray(ours), hf_logits(hf2, toks, lens), lens) <= 1e-4


def test_transformers5_rope_parameters_layout(tmp_path):
    """transformers 5 writes rope under `rope_parameters`; the hub's files have it at top level. Both load."""
    folder = str(tmp_path / "m")
    save_hf_model("llama31", folder)
    cfg = json.load(open(os.path.join(folder, "config.json")))
    model_a, _ = from_pretrained(folder)
    hub = dict(cfg)
    rp = hub.pop("rope_parameters", None) or {}
    hub["rope_theta"] = rp.get("rope_theta", cfg.get("rope_theta"))
    hub["rope_scaling"] = {k: v for k, v in rp.items() if k != "rope_theta"} or cfg.get("rope_scaling")
    json.dump(hub, open(os.path.join(folder, "config.json"), "w"))
    model_b, _ = from_pretrained(folder)
    assert model_a.cfg == model_b.cfg
    assert model_a.cfg.rope_scaling is not None and model_a.cfg.rope_scaling.original_max_position_embeddings == 1024
    assert model_a.cfg.rope_theta == 500000.0


def test_bf16_load_and_save(hf_pair, tmp_path):
    _, folder, _, model, params = hf_pair
    _, p16 = from_pretrained(folder, dtype=jnp.bfloat16)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(p16))
    out = str(tmp_path / "bf16")
    save_pretrained(model, p16, out)
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    assert next(reloaded.parameters()).dtype == torch.bfloat16
    _, again = from_pretrained(out, dtype=jnp.bfloat16)
    for a, b in zip(jax.tree.leaves(p16), jax.tree.leaves(again)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
