"""RL losses against an independent float64 NumPy reference; gradient accumulation; metrics; config validation."""

import dataclasses
import glob
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from omegaconf import OmegaConf

from asyncrl.train.loss_config import LOSS_NAMES, LossConfig
from asyncrl.train.losses import (
    LOSSES,
    compute_advantages,
    finalize_metrics,
    get_loss,
    keep_sequences,
    loss_weights,
    prepare_loss_inputs,
    reduce_metrics,
    register_loss,
)

B, T, G = 16, 12, 4  # sequences, padded length, group size
EPSILONS = {  # (epsilon_low, epsilon_high) per loss, as in the presets
    "grpo": (0.2, 0.2),
    "dapo": (0.2, 0.28),
    "dr_grpo": (0.2, 0.28),
    "rloo": (0.2, 0.2),
    "cispo": (0.2, 1.0),
}


NP_NORMALIZATION = {
    "grpo": "seq_mean", "rloo": "seq_mean", "dr_grpo": "constant", "dapo": "token_mean", "cispo": "token_mean"
}


def make_cfg(name: str, tis: bool = False, kl: bool = False, **kw) -> LossConfig:
    lo, hi = EPSILONS[name]
    return LossConfig(
        name=name, epsilon_low=lo, epsilon_high=hi, kl_coef=0.1 if kl else 0.0, tis_cap=1.5 if tis else None, **kw
    )


def make_batch(seed: int = 0) -> dict[str, np.ndarray]:
    """Random batch with padding, forced-token holes, an empty sequence and an all-equal-reward group."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, T + 1, size=B)
    lengths[5] = 0
    mask = np.arange(T)[None, :] < lengths[:, None]
    mask &= rng.random((B, T)) > 0.15  # forced tokens inside a completion carry no loss
    lp = np.log(rng.uniform(0.05, 0.95, size=(B, T)))
    # Trainer and sampler disagree by ~0.4 nats so that a good fraction of ratios leave [0.8, 1.28].
    sampler = lp + rng.normal(0.0, 0.4, size=(B, T))
    prox = lp + rng.normal(0.0, 0.4, size=(B, T))
    ref = lp + rng.normal(0.0, 0.2, size=(B, T))
    # Garbage where there is no loss token: it must not leak into loss, gradient or metrics.
    lp = np.where(mask, lp, 50.0)
    sampler = np.where(mask, sampler, -np.inf)
    ref = np.where(mask, ref, -np.inf)
    rewards = rng.integers(0, 2, size=B).astype(np.float64)
    rewards[4:8] = 1.0  # one group with zero variance
    group_ids = np.repeat(np.arange(B // G) * 7 + 3, G)  # non-dense ids
    return dict(lp=lp, sampler=sampler, prox=prox, ref=ref, mask=mask, rewards=rewards, group_ids=group_ids)


# ------------------------------------------------------------------------------------------ NumPy reference (f64)


def np_advantages(rewards, group_ids, name, std_eps=1e-6):
    out = np.zeros(len(rewards))
    for i, r in enumerate(rewards):
        grp = rewards[group_ids == group_ids[i]]
        n = len(grp)
        if name in ("grpo", "dapo"):
            std = grp.std(ddof=1) if n > 1 else 0.0
            out[i] = (r - grp.mean()) / (std + std_eps)
        elif name in ("dr_grpo", "cispo"):
            out[i] = r - grp.mean()
        else:
            out[i] = r - (grp.sum() - r) / (n - 1) if n > 1 else 0.0
    return out


def np_weights(mask, mode, keep=None, max_tokens=None):
    m = mask.astype(np.float64)
    if keep is not None:
        m = m * keep[:, None]
    w = np.zeros_like(m)
    if mode == "token_mean":
        w = m / max(m.sum(), 1.0)
    elif mode == "seq_mean":
        nonempty = [b for b in range(len(m)) if m[b].sum() > 0]
        for b in nonempty:
            w[b] = m[b] / (m[b].sum() * len(nonempty))
    else:
        n_seqs = len(m) if keep is None else keep.sum()
        w = m / (n_seqs * (max_tokens or m.shape[1]))
    return w


def np_loss_and_grad(lp, sampler, adv, w, mask, cfg, ref=None, prox=None, detach_at=None):
    """Loss and analytic d loss / d lp, one token at a time.

    Stop-gradient factors are evaluated at `detach_at` (default: lp), so that finite differences around
    detach_at see them as constants, which is what stop_gradient means."""
    loss, grad = 0.0, np.zeros_like(lp)
    frozen = lp if detach_at is None else detach_at
    lo, hi = 1.0 - cfg.epsilon_low, 1.0 + cfg.epsilon_high
    for b, t in itertools.product(range(lp.shape[0]), range(lp.shape[1])):
        if not mask[b, t]:
            continue
        x, a = lp[b, t], adv[b]
        old = sampler[b, t]
        tis = 1.0
        if cfg.tis_cap is not None:
            old = frozen[b, t] if prox is None else prox[b, t]
            tis = min(np.exp(old - sampler[b, t]), cfg.tis_cap)
        r = np.exp(x - old)  # dr/dx = r
        if cfg.name == "cispo":
            c = min(np.exp(frozen[b, t] - old), cfg.epsilon_high)
            obj, g = -c * a * x, -c * a
        else:
            unclipped, clipped = r * a, np.clip(r, lo, hi) * a
            if unclipped <= clipped:
                obj, g = -unclipped, -a * r
            else:  # only possible outside [lo, hi], where the clipped branch is flat
                obj, g = -clipped, 0.0
        loss += w[b, t] * tis * obj
        grad[b, t] += w[b, t] * tis * g
        if cfg.kl_coef > 0:
            d = ref[b, t] - x
            loss += cfg.kl_coef * w[b, t] * (np.exp(d) - d - 1.0)
            grad[b, t] += cfg.kl_coef * w[b, t] * (1.0 - np.exp(d))
    return loss, grad


@pytest.mark.parametrize("name", LOSS_NAMES)
def test_numpy_reference_gradient_matches_finite_differences(name):
    """Guards the reference itself: its analytic gradient against central differences (all terms on)."""
    cfg = make_cfg(name, tis=True, kl=True)
    batch = make_batch(6)
    adv = np_advantages(batch["rewards"], batch["group_ids"], name)
    w = np_weights(batch["mask"], "token_mean")
    lp0 = batch["lp"]
    args = lambda lp: (lp, batch["sampler"], adv, w, batch["mask"], cfg, batch["ref"], batch["prox"], lp0)  # noqa: E731
    _, grad = np_loss_and_grad(*args(lp0))
    h = 1e-6
    for b, t in zip(*np.nonzero(batch["mask"])):
        up, down = lp0.copy(), lp0.copy()
        up[b, t] += h
        down[b, t] -= h
        fd = (np_loss_and_grad(*args(up))[0] - np_loss_and_grad(*args(down))[0]) / (2 * h)
        np.testing.assert_allclose(fd, grad[b, t], rtol=1e-4, atol=1e-8)


# ------------------------------------------------------------------------------------------ helpers


def loss_and_grad(cfg: LossConfig):
    """value_and_grad of the named loss wrt logprobs. Run eagerly: per-op executables are cached across cases,
    where a jit per config would cost a compile each (see test_loss_under_jit)."""
    fn = get_loss(cfg.name)

    def go(lp, sampler, adv, w, mask, ref, prox):
        def loss(lp):
            return fn(lp, sampler, adv, w, mask, cfg, ref if cfg.kl_coef > 0 else None, prox_logprobs=prox)

        return jax.value_and_grad(loss, has_aux=True)(lp)

    return go


def f32_inputs(batch, adv, w, rows=slice(None), use_prox=False):
    f32 = lambda x: jnp.asarray(x[rows], jnp.float32)  # noqa: E731
    prox = f32(batch["prox"]) if use_prox else None
    mask = jnp.asarray(batch["mask"][rows])
    return f32(batch["lp"]), f32(batch["sampler"]), f32(adv), f32(w), mask, f32(batch["ref"]), prox


def run_loss(cfg, batch, adv, w, rows=slice(None), use_prox=False):
    """value, grad wrt logprobs and metrics of the JAX loss on batch[rows], in float32."""
    (value, metrics), grad = loss_and_grad(cfg)(*f32_inputs(batch, adv, w, rows, use_prox))
    return value, grad, metrics


TIS_MODES = ["off", "prox", "self"]  # no TIS / TIS against given proximal logprobs / against sg(trainer logprobs)


@pytest.mark.parametrize("kl", [False, True], ids=["nokl", "kl"])
@pytest.mark.parametrize("tis", TIS_MODES)
@pytest.mark.parametrize("name", LOSS_NAMES)
def test_loss_matches_numpy(name, tis, kl):
    cfg = make_cfg(name, tis=tis != "off", kl=kl)
    batch = make_batch()
    adv = np_advantages(batch["rewards"], batch["group_ids"], name)
    w = np_weights(batch["mask"], NP_NORMALIZATION[name])
    prox = batch["prox"] if tis == "prox" else None
    # The reference sees the values the float32 JAX side sees, so only arithmetic differs.
    as32 = lambda x: x.astype(np.float32).astype(np.float64)  # noqa: E731
    want, want_grad = np_loss_and_grad(
        as32(batch["lp"]), as32(batch["sampler"]), as32(adv), as32(w), batch["mask"], cfg, as32(batch["ref"]),
        None if prox is None else as32(prox),
    )
    value, grad, metrics = run_loss(cfg, batch, adv, w, use_prox=tis == "prox")
    assert np.isfinite(float(value)) and np.all(np.isfinite(grad))
    np.testing.assert_allclose(float(value), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(grad)[~batch["mask"]] == 0)
    clip_frac = float(metrics["clip_tokens"] / metrics["token_count"])
    if tis == "self":
        assert clip_frac == 0.0 and float(metrics["is_ratio_max"]) == 1.0  # the proximal policy is the trainer
    else:
        assert clip_frac > 0.1


@pytest.mark.parametrize("extras", [False, True], ids=["plain", "tis_kl"])
@pytest.mark.parametrize("name", LOSS_NAMES)
def test_micro_batches_sum_to_full_batch(name, extras):
    cfg = make_cfg(name, tis=extras, kl=extras)
    batch = make_batch(1)
    adv, w = prepare_loss_inputs(
        jnp.asarray(batch["rewards"], jnp.float32), jnp.asarray(batch["group_ids"]), jnp.asarray(batch["mask"]), cfg
    )
    adv, w = np.asarray(adv), np.asarray(w)
    full_value, full_grad, full_metrics = run_loss(cfg, batch, adv, w, use_prox=extras)
    parts = [run_loss(cfg, batch, adv, w, rows=slice(i, i + B // 4), use_prox=extras) for i in range(0, B, B // 4)]
    np.testing.assert_allclose(sum(float(p[0]) for p in parts), float(full_value), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.concatenate([p[1] for p in parts]), full_grad, rtol=1e-5, atol=1e-6)
    reduced = reduce_metrics([p[2] for p in parts])
    assert set(reduced) == set(full_metrics)
    for k, v in reduced.items():
        np.testing.assert_allclose(float(v), float(full_metrics[k]), rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("name", ["grpo", "cispo"])
def test_loss_under_jit(name):
    cfg = make_cfg(name, tis=True, kl=True)
    batch = make_batch(5)
    adv, w = prepare_loss_inputs(
        jnp.asarray(batch["rewards"], jnp.float32), jnp.asarray(batch["group_ids"]), jnp.asarray(batch["mask"]), cfg
    )
    args = f32_inputs(batch, np.asarray(adv), np.asarray(w), use_prox=True)
    (value, metrics), grad = jax.jit(loss_and_grad(cfg))(*args)
    (want, want_metrics), want_grad = loss_and_grad(cfg)(*args)
    # XLA fuses and reorders the f32 sums under jit, hence the same 1e-5 as against NumPy.
    np.testing.assert_allclose(float(value), float(want), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(want_grad), rtol=1e-5, atol=1e-7)
    for k in want_metrics:
        np.testing.assert_allclose(float(metrics[k]), float(want_metrics[k]), rtol=1e-5, atol=1e-7, err_msg=k)


def test_finalized_metrics_match_numpy():
    cfg = make_cfg("grpo", tis=True, kl=True)
    batch = make_batch(2)
    m = batch["mask"]
    adv = np_advantages(batch["rewards"], batch["group_ids"], "grpo")
    w = np_weights(m, "seq_mean")
    parts = [run_loss(cfg, batch, adv, w, rows=slice(i, i + 4), use_prox=True)[2] for i in range(0, B, 4)]
    out = finalize_metrics(reduce_metrics(parts))
    lp, sampler, prox, ref = (batch[k].astype(np.float32).astype(np.float64) for k in ("lp", "sampler", "prox", "ref"))
    ratio = np.exp(lp - prox)[m]
    raw_tis = np.exp(prox - sampler)[m]
    d = (ref - lp)[m]
    a = np.broadcast_to(adv[:, None], m.shape)[m]
    clipped = ((a > 0) & (ratio > 1.2)) | ((a < 0) & (ratio < 0.8))
    want = {
        "token_count": m.sum(),
        "is_ratio": ratio.mean(),
        "is_ratio_min": ratio.min(),
        "is_ratio_max": ratio.max(),
        "clip_frac": clipped.mean(),
        "logprob_gap": np.abs(sampler - lp)[m].mean(),
        "kl": (np.exp(d) - d - 1).mean(),
        "tis_weight": np.minimum(raw_tis, 1.5).mean(),
        "tis_truncated_frac": (raw_tis > 1.5).mean(),
    }
    for k, v in want.items():
        np.testing.assert_allclose(float(out[k]), v, rtol=1e-5, err_msg=k)
    assert {"loss", "pg_loss", "kl_loss"} <= set(out)


def test_reduce_metrics_rule():
    a = {"x_sum": 1.0, "y_min": 3.0, "y_max": 3.0, "token_count": 2.0, "c_tokens": 1.0}
    b = {"x_sum": 5.0, "y_min": -1.0, "y_max": 7.0, "token_count": 4.0, "c_tokens": 2.0}
    r = reduce_metrics([a, b])
    assert (float(r["x_sum"]), float(r["y_min"]), float(r["y_max"])) == (6.0, -1.0, 7.0)
    f = finalize_metrics(r)
    assert (float(f["x"]), float(f["c_frac"]), float(f["token_count"])) == (1.0, 0.5, 6.0)
    with pytest.raises(ValueError, match="keys differ"):
        reduce_metrics([a, {"x_sum": 1.0}])


@pytest.mark.parametrize("name", LOSS_NAMES)
def test_advantages_match_numpy(name):
    rng = np.random.default_rng(3)
    # Uneven, shuffled groups including a singleton.
    group_ids = rng.permutation(np.array([9] * 5 + [2] * 3 + [40] + [7] * 4 + [11] * 3))
    rewards = rng.normal(size=group_ids.shape)
    got = compute_advantages(jnp.asarray(rewards, jnp.float32), jnp.asarray(group_ids), LossConfig(name=name))
    np.testing.assert_allclose(np.asarray(got), np_advantages(rewards, group_ids, name), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["seq_mean", "token_mean", "constant"])
@pytest.mark.parametrize("filter_zero_variance", [False, True])
def test_loss_weights_match_numpy(mode, filter_zero_variance):
    batch = make_batch(4)
    cfg = LossConfig(name="grpo", normalization=mode, filter_zero_variance=filter_zero_variance, max_tokens=20)
    keep = keep_sequences(jnp.asarray(batch["rewards"]), jnp.asarray(batch["group_ids"]), cfg)
    rewards_equal = np.array([np.ptp(batch["rewards"][batch["group_ids"] == g]) == 0 for g in batch["group_ids"]])
    np.testing.assert_array_equal(np.asarray(keep), ~rewards_equal if filter_zero_variance else np.ones(B, bool))
    got = loss_weights(jnp.asarray(batch["mask"]), cfg, keep)
    want = np_weights(batch["mask"], mode, np.asarray(keep, np.float64), max_tokens=20)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-9)


def test_registry():
    assert set(LOSSES) == set(LOSS_NAMES)
    with pytest.raises(ValueError, match="unknown loss"):
        get_loss("ppo2")
    with pytest.raises(ValueError, match="already registered"):
        register_loss("grpo")(get_loss("grpo"))


def test_kl_without_reference_raises():
    batch = make_batch()
    with pytest.raises(ValueError, match="ref_logprobs"):
        get_loss("grpo")(*(jnp.asarray(batch[k]) for k in ("lp", "sampler")), jnp.zeros(B), jnp.ones((B, T)),
                         jnp.asarray(batch["mask"]), make_cfg("grpo", kl=True))


@pytest.mark.parametrize(
    "field,value",
    [("name", "ppo"), ("epsilon_low", 1.0), ("epsilon_low", -0.1), ("epsilon_high", 0.0), ("kl_coef", -1.0),
     ("tis_cap", 0.5), ("std_eps", 0.0), ("normalization", "sum"), ("max_tokens", 0)],
)
def test_config_validation_names_key(field, value):
    with pytest.raises(ValueError, match=rf"loss\.{field}=.*must be"):
        LossConfig(**{field: value})


def test_presets_load_and_validate():
    paths = sorted(glob.glob("configs/loss/*.yaml"))
    assert {p.split("/")[-1][:-5] for p in paths} == set(LOSS_NAMES)
    for path in paths:
        raw = OmegaConf.load(path)
        assert set(raw) <= {f.name for f in dataclasses.fields(LossConfig)}, path
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(LossConfig), raw))
        assert cfg.name == path.split("/")[-1][:-5]
    with pytest.raises(ValueError, match=r"loss\.epsilon_high"):
        OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(LossConfig), {"epsilon_high": -1.0}))
