"""RL losses against an independent float64 NumPy reference; gradient accumulation; metrics; config validation."""

import dataclasses
import glob
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from omegaconf import OmegaConf

from asyncrl.train.advantages import compute_advantages, keep_sequences, loss_weights, prepare_loss_inputs
from asyncrl.train.loss_config import LossConfig
from asyncrl.train.losses import finalize_metrics, reduce_metrics
from asyncrl.train.registry import (
    ADVANTAGES,
    LOSSES,
    SHARED_FIELDS,
    AdvantageSpec,
    LossSpec,
    get_advantage,
    get_loss,
    register_advantage,
    register_loss,
    validate,
)

LOSS_NAMES = sorted(LOSSES)

B, T, G = 16, 12, 4  # sequences, padded length, group size
MAX_TOKENS = 20  # dr_grpo's constant normaliser (the generation budget), deliberately not T
EPSILONS = {  # (epsilon_low, epsilon_high) per loss, as in the presets
    "grpo": (0.2, 0.2),
    "dapo": (0.2, 0.28),
    "dr_grpo": (0.2, 0.28),
    "rloo": (0.2, 0.2),
    "cispo": (0.2, 1.0),
    "gspo": (3e-4, 4e-4),
    "gspo_token": (3e-4, 4e-4),
}
PPO_FAMILY = ("grpo", "dapo", "dr_grpo", "rloo")


NP_NORMALIZATION = {
    "grpo": "seq_mean", "rloo": "seq_mean", "dr_grpo": "constant", "dapo": "token_mean", "cispo": "token_mean",
    "gspo": "seq_mean", "gspo_token": "seq_mean",
}
# Caps per correction level: a geometric mean over a row moves far less than a token's or a row's product weight,
# so its caps are tighter (as in practice); each puts the test batches' weights on both sides (checked below).
TIS_CAP = {"token": 1.5, "sequence": 1.5, "geometric": 1.2}
MASK_BAND = {"token": (0.5, 2.0), "sequence": (0.5, 2.0), "geometric": (0.75, 1.25)}


def make_cfg(name: str, tis: bool = False, kl: bool = False, mode: str | None = None, level: str = "token",
             **kw) -> LossConfig:
    """`tis=True` is token-level truncation at TIS_CAP; `mode`/`level` pick any other correction."""
    lo, hi = EPSILONS[name]
    mode = mode or ("truncate" if tis else None)
    kw.setdefault("max_tokens", MAX_TOKENS)
    return LossConfig(
        name=name, epsilon_low=lo, epsilon_high=hi, kl_coef=0.1 if kl else 0.0, is_mode=mode, is_level=level,
        tis_cap=TIS_CAP[level] if mode == "truncate" else None, is_mask_low=MASK_BAND[level][0],
        is_mask_high=MASK_BAND[level][1], **kw
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
        if name in ("grpo", "dapo", "gspo", "gspo_token"):
            std = grp.std(ddof=1) if n > 1 else 0.0
            out[i] = (r - grp.mean()) / (std + std_eps)
        elif name in ("dr_grpo", "cispo"):
            out[i] = r - grp.mean()
        else:
            out[i] = r - (grp.sum() - r) / (n - 1) if n > 1 else 0.0
    return out


def np_weights(mask, mode, keep=None, max_tokens=MAX_TOKENS):
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
        w = m / (n_seqs * max_tokens)
    return w


def np_correction(old, sampler, cfg):
    """Per token of one row (loss tokens only): the detached weight pi_old / pi_sampler after truncation or
    masking, from the definitions: TIS min(w, C); MIS w inside [C_low, C_high], else 0; w per token, the product
    over the row (sequence) or its geometric mean."""
    log_w = old - sampler
    if cfg.is_level == "sequence":
        log_w = np.full_like(log_w, log_w.sum())
    elif cfg.is_level == "geometric":
        log_w = np.full_like(log_w, log_w.mean())
    w = np.exp(log_w)
    if cfg.correction == "truncate":
        return np.minimum(w, cfg.tis_cap), w
    return np.where((w >= cfg.is_mask_low) & (w <= cfg.is_mask_high), w, 0.0), w


def np_clip_branch(r, a, cfg):
    """PPO's pessimistic surrogate -min(r A, clip(r) A) and its derivative in r."""
    lo, hi = 1.0 - cfg.epsilon_low, 1.0 + cfg.epsilon_high
    unclipped, clipped = r * a, np.clip(r, lo, hi) * a
    if unclipped <= clipped:
        return -unclipped, -a
    return -clipped, 0.0  # only possible outside [lo, hi], where the clipped branch is flat


def np_loss_and_grad(lp, sampler, adv, w, mask, cfg, ref=None, prox=None, detach_at=None):
    """Loss and analytic d loss / d lp, one row at a time, written from each paper's formula.

    Stop-gradient factors are evaluated at `detach_at` (default: lp), so that finite differences around
    detach_at see them as constants, which is what stop_gradient means."""
    loss, grad = 0.0, np.zeros_like(lp)
    frozen = lp if detach_at is None else detach_at
    for b in range(lp.shape[0]):
        ts = np.nonzero(mask[b])[0]
        if len(ts) == 0:
            continue
        x, a, wt = lp[b, ts], adv[b], w[b, ts]
        if prox is not None:
            old = prox[b, ts]
        elif cfg.correction != "off":
            old = frozen[b, ts]
        else:
            old = sampler[b, ts]
        c = np_correction(old, sampler[b, ts], cfg)[0] if cfg.correction != "off" else np.ones(len(ts))
        if cfg.name in PPO_FAMILY:  # r_t = exp(x_t - old_t), dr/dx = r
            for i in range(len(ts)):
                r = np.exp(x[i] - old[i])
                obj, dobj_dr = np_clip_branch(r, a, cfg)
                loss += wt[i] * c[i] * obj
                grad[b, ts[i]] += wt[i] * c[i] * dobj_dr * r
        elif cfg.name == "cispo":  # -sg(min(r, eps_high)) A x
            for i in range(len(ts)):
                cap = min(np.exp(frozen[b, ts[i]] - old[i]), cfg.epsilon_high)
                loss += wt[i] * c[i] * -cap * a * x[i]
                grad[b, ts[i]] += wt[i] * c[i] * -cap * a
        elif cfg.name == "gspo":  # s = exp(mean_t (x_t - old_t)), ds/dx_t = s / |y|
            s = np.exp(np.mean(x - old))
            obj, dobj_ds = np_clip_branch(s, a, cfg)
            loss += np.sum(wt * c) * obj
            grad[b, ts] += np.sum(wt * c) * dobj_ds * s / len(ts)
        else:  # gspo_token: r_t = sg(s) * exp(x_t - sg(x_t)), value s, dr_t/dx_t = s
            s = np.exp(np.mean(frozen[b, ts] - old))
            for i in range(len(ts)):
                r = s * np.exp(x[i] - frozen[b, ts[i]])
                obj, dobj_dr = np_clip_branch(r, a, cfg)
                loss += wt[i] * c[i] * obj
                grad[b, ts[i]] += wt[i] * c[i] * dobj_dr * r
        if cfg.kl_coef > 0:
            d = ref[b, ts] - x
            loss += cfg.kl_coef * np.sum(wt * (np.exp(d) - d - 1.0))
            grad[b, ts] += cfg.kl_coef * wt * (1.0 - np.exp(d))
    return loss, grad


@pytest.mark.parametrize("mode,level", [("truncate", "token"), ("mask", "sequence"), ("truncate", "geometric")])
@pytest.mark.parametrize("name", LOSS_NAMES)
def test_numpy_reference_gradient_matches_finite_differences(name, mode, level):
    """Guards the reference itself: its analytic gradient against central differences (all terms on)."""
    cfg = make_cfg(name, kl=True, mode=mode, level=level)
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


# name -> (proximal logprobs given, correction mode, level, KL term). "self": a correction with no proximal
# logprobs (one update per batch), where the proximal policy is the trainer's own sg(logprobs).
VARIANTS = {
    "plain": (False, None, "token", False),
    "plain_kl": (False, None, "token", True),
    "prox": (True, None, "token", False),
    "tis_self": (False, "truncate", "token", False),
    "tis_token": (True, "truncate", "token", True),
    "tis_seq": (True, "truncate", "sequence", False),
    "tis_geo": (True, "truncate", "geometric", False),
    "mis_token": (True, "mask", "token", False),
    "mis_seq": (True, "mask", "sequence", True),
    "mis_geo": (True, "mask", "geometric", False),
}


def variant_cfg(name: str, variant: str) -> tuple[LossConfig, bool]:
    use_prox, mode, level, kl = VARIANTS[variant]
    return make_cfg(name, kl=kl, mode=mode, level=level), use_prox


def as32(x):
    """What the float32 JAX side sees, back in float64: the reference then differs only in arithmetic."""
    return x.astype(np.float32).astype(np.float64)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("name", LOSS_NAMES)
def test_loss_matches_numpy(name, variant):
    cfg, use_prox = variant_cfg(name, variant)
    batch = make_batch()
    adv = np_advantages(batch["rewards"], batch["group_ids"], name)
    w = np_weights(batch["mask"], NP_NORMALIZATION[name])
    prox = batch["prox"] if use_prox else None
    want, want_grad = np_loss_and_grad(
        as32(batch["lp"]), as32(batch["sampler"]), as32(adv), as32(w), batch["mask"], cfg, as32(batch["ref"]),
        None if prox is None else as32(prox),
    )
    value, grad, metrics = run_loss(cfg, batch, adv, w, use_prox=use_prox)
    assert np.isfinite(float(value)) and np.all(np.isfinite(grad))
    np.testing.assert_allclose(float(value), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(grad)[~batch["mask"]] == 0)
    assert np.any(np.asarray(grad)[batch["mask"]] != 0)
    clip_frac = float(metrics["clip_tokens"] / metrics["token_count"])
    if variant == "tis_self":
        assert clip_frac == 0.0 and float(metrics["is_ratio_max"]) == 1.0  # the proximal policy is the trainer
    else:
        assert clip_frac > 0.1


def _clip_sides(name, batch, use_prox):
    """(clipped with A > 0 and ratio above 1 + eps_high, clipped with A < 0 and ratio below 1 - eps_low) counts."""
    cfg = make_cfg(name)
    old = batch["prox"] if use_prox else batch["sampler"]
    adv = np_advantages(batch["rewards"], batch["group_ids"], name)
    m = batch["mask"]
    log_r = np.where(m, batch["lp"] - old, 0.0)
    if name.startswith("gspo"):
        log_r = np.where(m, (log_r.sum(1) / np.maximum(m.sum(1), 1))[:, None], 0.0)
    r, a = np.exp(log_r), np.broadcast_to(adv[:, None], m.shape)
    return int(np.sum(m & (a > 0) & (r > 1 + cfg.epsilon_high))), int(np.sum(m & (a < 0) & (r < 1 - cfg.epsilon_low)))


@pytest.mark.parametrize("name", [n for n in LOSS_NAMES if n != "cispo"])
def test_cases_clip_on_both_sides(name):
    """The random batches exercise both sides of every clip the objectives above are compared on."""
    for use_prox in (False, True):
        up, down = _clip_sides(name, make_batch(), use_prox)
        assert up > 0 and down > 0, (use_prox, up, down)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_cases_put_is_weights_on_both_sides_of_the_caps(level, seed):
    batch = make_batch(seed)
    m = batch["mask"]
    rows = [np_correction(batch["prox"][b, m[b]], batch["sampler"][b, m[b]], make_cfg("grpo", mode="mask",
                                                                                      level=level))[1]
            for b in range(B) if m[b].any()]
    w = np.concatenate(rows)
    (low, high), cap = MASK_BAND[level], TIS_CAP[level]
    assert np.any(w > cap) and np.any(w < cap)
    assert np.any(w < low) and np.any(w > high) and np.any((w >= low) & (w <= high))


def test_gspo_token_equals_gspo_with_sequence_advantages():
    """GSPO-token's ratio has GSPO's value and, with one advantage per row, GSPO's gradient (GSPO paper, sec. 4)."""
    batch = make_batch(3)
    adv = np_advantages(batch["rewards"], batch["group_ids"], "gspo")
    w = np_weights(batch["mask"], "seq_mean")
    v1, g1, m1 = run_loss(make_cfg("gspo"), batch, adv, w, use_prox=True)
    v2, g2, m2 = run_loss(make_cfg("gspo_token"), batch, adv, w, use_prox=True)
    np.testing.assert_allclose(float(v2), float(v1), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(g2), np.asarray(g1), rtol=1e-5, atol=1e-9)
    assert float(m1["clip_tokens"]) == float(m2["clip_tokens"]) > 0


@pytest.mark.parametrize("variant", ["plain", "tis_token", "mis_seq", "tis_geo"])
@pytest.mark.parametrize("name", LOSS_NAMES)
def test_micro_batches_sum_to_full_batch(name, variant):
    cfg, use_prox = variant_cfg(name, variant)
    batch = make_batch(1)
    adv, w = prepare_loss_inputs(
        jnp.asarray(batch["rewards"], jnp.float32), jnp.asarray(batch["group_ids"]), jnp.asarray(batch["mask"]), cfg
    )
    adv, w = np.asarray(adv), np.asarray(w)
    full_value, full_grad, full_metrics = run_loss(cfg, batch, adv, w, use_prox=use_prox)
    parts = [run_loss(cfg, batch, adv, w, rows=slice(i, i + B // 4), use_prox=use_prox) for i in range(0, B, B // 4)]
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


@pytest.mark.parametrize("mode,level", [("truncate", "token"), ("mask", "geometric")])
def test_finalized_metrics_match_numpy(mode, level):
    cfg = make_cfg("grpo", kl=True, mode=mode, level=level)
    batch = make_batch(2)
    m = batch["mask"]
    adv = np_advantages(batch["rewards"], batch["group_ids"], "grpo")
    w = np_weights(m, "seq_mean")
    parts = [run_loss(cfg, batch, adv, w, rows=slice(i, i + 4), use_prox=True)[2] for i in range(0, B, 4)]
    out = finalize_metrics(reduce_metrics(parts))
    lp, sampler, prox, ref = (as32(batch[k]) for k in ("lp", "sampler", "prox", "ref"))
    ratio = np.exp(lp - prox)[m]
    applied, raw = (np.concatenate(x) for x in zip(*[np_correction(prox[b, m[b]], sampler[b, m[b]], cfg)
                                                     for b in range(B) if m[b].any()]))
    d = (ref - lp)[m]
    a = np.broadcast_to(adv[:, None], m.shape)[m]
    clipped = ((a > 0) & (ratio > 1.2)) | ((a < 0) & (ratio < 0.8))
    touched = raw > TIS_CAP[level] if mode == "truncate" else (raw < MASK_BAND[level][0]) | (raw > MASK_BAND[level][1])
    want = {
        "token_count": m.sum(),
        "is_ratio": ratio.mean(),
        "is_ratio_min": ratio.min(),
        "is_ratio_max": ratio.max(),
        "clip_frac": clipped.mean(),
        "logprob_gap": np.abs(sampler - lp)[m].mean(),
        "kl": (np.exp(d) - d - 1).mean(),
        "is_weight": raw.mean(),
        "is_weight_min": raw.min(),
        "is_weight_max": raw.max(),
        f"is_{'truncated' if mode == 'truncate' else 'masked'}_frac": touched.mean(),
        "is_applied": applied.mean(),
        "is_ess": applied.sum() ** 2 / (len(applied) * np.sum(applied**2)),
    }
    assert 0 < touched.mean() < 1 and 0 < want["is_ess"] < 1
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
    got = compute_advantages(jnp.asarray(rewards, jnp.float32), jnp.asarray(group_ids), make_cfg(name))
    np.testing.assert_allclose(np.asarray(got), np_advantages(rewards, group_ids, name), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["seq_mean", "token_mean", "constant"])
@pytest.mark.parametrize("filter_zero_variance", [False, True])
def test_loss_weights_match_numpy(mode, filter_zero_variance):
    batch = make_batch(4)
    cfg = LossConfig(name="grpo", normalization=mode, filter_zero_variance=filter_zero_variance, max_tokens=MAX_TOKENS)
    keep = keep_sequences(jnp.asarray(batch["rewards"]), jnp.asarray(batch["group_ids"]), cfg)
    rewards_equal = np.array([np.ptp(batch["rewards"][batch["group_ids"] == g]) == 0 for g in batch["group_ids"]])
    np.testing.assert_array_equal(np.asarray(keep), ~rewards_equal if filter_zero_variance else np.ones(B, bool))
    got = loss_weights(jnp.asarray(batch["mask"]), cfg, keep)
    want = np_weights(batch["mask"], mode, np.asarray(keep, np.float64))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-9)


def test_registry():
    assert LOSS_NAMES == ["cispo", "dapo", "dr_grpo", "grpo", "gspo", "gspo_token", "rloo"]
    with pytest.raises(ValueError, match="unknown loss"):
        get_loss("ppo2")
    with pytest.raises(ValueError, match="already registered"):
        register_loss(get_loss("grpo"))
    fields = {f.name for f in dataclasses.fields(LossConfig)}
    for spec in LOSSES.values():  # every entry says everything about its loss
        assert isinstance(spec, LossSpec) and spec.advantage in ADVANTAGES
        assert spec.normalization in ("seq_mean", "token_mean", "constant") and spec.source
        assert set(spec.reads) <= fields - set(SHARED_FIELDS) - {"name"}
        assert set(ADVANTAGES[spec.advantage].reads) <= set(spec.reads)
    assert sorted(ADVANTAGES) == ["group_mean", "group_std", "leave_one_out"]
    for est in ADVANTAGES.values():
        assert isinstance(est, AdvantageSpec) and set(est.reads) <= fields and est.source
    with pytest.raises(ValueError, match="unknown advantage estimator 'baseline'"):
        get_advantage("baseline")
    with pytest.raises(ValueError, match="already registered"):
        register_advantage(get_advantage("group_std"))
    with pytest.raises(ValueError, match="unknown advantage estimator 'baseline'"):
        register_loss(LossSpec("test_bad", get_loss("grpo").per_token, "baseline", "seq_mean", (), "a test"))
    with pytest.raises(ValueError, match=r"'group_std' reads \['std_eps'\]"):
        register_loss(LossSpec("test_bad", get_loss("grpo").per_token, "group_std", "seq_mean", (), "a test"))
    assert "test_bad" not in LOSSES


def test_a_new_advantage_estimator_is_one_registry_entry():
    """Registering one AdvantageSpec is all a new estimator needs: a loss names it, and the step's advantages
    follow (here the raw reward, REINFORCE without a baseline)."""
    from asyncrl.train import losses

    register_advantage(AdvantageSpec("test_raw", lambda r, g, cfg: r, (), "a test"))
    register_loss(LossSpec("test_raw_loss", losses.ppo_clip, "test_raw", "seq_mean", ("epsilon_low", "epsilon_high"),
                           "a test"))
    try:
        batch = make_batch()
        got = compute_advantages(jnp.asarray(batch["rewards"]), jnp.asarray(batch["group_ids"]),
                                 LossConfig(name="test_raw_loss"))
        np.testing.assert_array_equal(np.asarray(got), batch["rewards"].astype(np.float32))
    finally:
        del LOSSES["test_raw_loss"], ADVANTAGES["test_raw"]


def test_a_new_loss_is_one_registry_entry():
    """Registering one LossSpec is all a new loss needs: the config accepts its name, and the advantages, the token
    normalisation and the loss itself follow its entry."""
    from asyncrl.train import losses

    spec = LossSpec("test_reinforce", losses.cispo, "leave_one_out", "token_mean", ("epsilon_high",), "a test")
    register_loss(spec)
    try:
        cfg = LossConfig(name="test_reinforce", epsilon_high=1.0)
        validate(cfg)
        batch = make_batch()
        adv, w = prepare_loss_inputs(jnp.asarray(batch["rewards"]), jnp.asarray(batch["group_ids"]),
                                     jnp.asarray(batch["mask"]), cfg)
        np.testing.assert_allclose(np.asarray(adv), np_advantages(batch["rewards"], batch["group_ids"], "rloo"),
                                   rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(w), np_weights(batch["mask"], "token_mean"), rtol=1e-6, atol=1e-9)
        loss, _ = get_loss("test_reinforce")(jnp.asarray(batch["lp"]), jnp.asarray(batch["sampler"]), adv, w,
                                             jnp.asarray(batch["mask"]), cfg)
        assert np.isfinite(float(loss))
    finally:
        del LOSSES["test_reinforce"]


def test_readme_table_lists_exactly_the_registered_losses():
    readme = open("README.md").read()
    listed = set(re.findall(r"^\| `loss\.name=(\w+)` \|", readme, flags=re.M))
    assert listed == set(LOSSES), sorted(listed ^ set(LOSSES))


def test_kl_without_reference_raises():
    batch = make_batch()
    with pytest.raises(ValueError, match="ref_logprobs"):
        get_loss("grpo")(*(jnp.asarray(batch[k]) for k in ("lp", "sampler")), jnp.zeros(B), jnp.ones((B, T)),
                         jnp.asarray(batch["mask"]), make_cfg("grpo", kl=True))


@pytest.mark.parametrize(
    "field,value",
    [("name", "ppo"), ("epsilon_low", 1.0), ("epsilon_low", -0.1), ("epsilon_high", 0.0), ("kl_coef", -1.0),
     ("tis_cap", 0.5), ("std_eps", 0.0), ("normalization", "sum"), ("max_tokens", 0), ("is_mode", "clip"),
     ("is_level", "row"), ("is_mask_low", 1.5), ("is_mask_high", 0.9), ("overlong_buffer", 0),
     ("overlong_penalty", -1.0)],
)
def test_config_validation_names_key(field, value):
    with pytest.raises(ValueError, match=rf"loss\.{field}=.*must be"):
        validate(LossConfig(**{field: value}))  # the name against the registry, the rest on construction


def test_config_validation_of_combinations():
    with pytest.raises(ValueError, match=r"loss\.tis_cap=None.*loss\.is_mode=truncate"):
        LossConfig(is_mode="truncate")
    with pytest.raises(ValueError, match=r"loss\.tis_cap=2\.0.*is_mode=mask"):
        LossConfig(is_mode="mask", tis_cap=2.0)
    with pytest.raises(ValueError, match=r"loss\.overlong_buffer=64.*< loss\.max_tokens=64"):
        LossConfig(overlong_buffer=64, max_tokens=64)
    assert LossConfig(tis_cap=2.0).correction == "truncate" and LossConfig().correction == "off"


def test_cispo_refuses_an_epsilon_high_below_one():
    """CISPO's epsilon_high is the cap itself: 0.2 (the PPO default) would cut every token's weight to 0.2."""
    with pytest.raises(ValueError, match=r"loss\.epsilon_high=0\.2 .*cispo.*>= 1.*5x learning-rate cut"):
        validate(LossConfig(name="cispo", epsilon_high=0.2))
    validate(LossConfig(name="cispo", epsilon_high=1.28))


def test_constant_normalisation_needs_the_generation_budget():
    """Dr.GRPO divides by a fixed budget, never by the batch's padded length."""
    mask = jnp.asarray(make_batch()["mask"])
    with pytest.raises(ValueError, match=r"loss\.max_tokens is unset"):
        loss_weights(mask, LossConfig(name="dr_grpo"))
    w = loss_weights(mask, LossConfig(name="dr_grpo", max_tokens=MAX_TOKENS))
    np.testing.assert_allclose(np.asarray(w), np.asarray(make_batch()["mask"]) / (B * MAX_TOKENS), rtol=1e-6)


def test_presets_load_and_validate():
    paths = sorted(glob.glob("configs/loss/*.yaml"))
    assert {p.split("/")[-1][:-5] for p in paths} == set(LOSS_NAMES)
    for path in paths:
        raw = OmegaConf.load(path)
        assert set(raw) <= {f.name for f in dataclasses.fields(LossConfig)}, path
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(LossConfig), raw))
        assert cfg.name == path.split("/")[-1][:-5]
        # Each preset states the fields its loss reads, and they are the ones its registry entry lists.
        reads = [line for line in open(path) if line.startswith("# Reads:")]
        assert len(reads) == 1, path
        stated = {f.strip() for f in reads[0].removeprefix("# Reads:").split("(")[0].split(",")}
        assert stated == set(LOSSES[cfg.name].reads), (path, stated)
        assert set(raw) - {"name"} <= set(LOSSES[cfg.name].reads) | set(SHARED_FIELDS), path
    with pytest.raises(ValueError, match=r"loss\.epsilon_high"):
        OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(LossConfig), {"epsilon_high": -1.0}))


def _gspo_pair_grads(tis_cap):
    """gspo and gspo_token on one 2 x 3 batch: (values, gradients w.r.t. the trainer's logprobs)."""
    lp = jnp.asarray([[-1.0, -0.5, -2.0], [-0.3, -1.2, -0.8]])
    sampler = jnp.asarray([[-1.1, -0.9, -1.5], [-0.3, -1.0, -0.9]])
    mask = jnp.ones((2, 3), bool)
    adv = jnp.asarray([1.0, -1.0])
    out = {}
    for name in ("gspo", "gspo_token"):
        cfg = LossConfig(name=name, epsilon_low=0.2, epsilon_high=0.2, tis_cap=tis_cap, max_tokens=3)
        w = loss_weights(mask, cfg)
        fn = lambda x, cfg=cfg, w=w: get_loss(cfg.name)(x, sampler, adv, w, mask, cfg)[0]  # noqa: E731
        out[name] = (float(fn(lp)), np.asarray(jax.grad(fn)(lp)))
    return out


def test_gspo_and_gspo_token_agree_in_value_and_differ_in_gradient_only_under_a_token_level_correction():
    """Without a token-level correction the two are one loss. With `tis_cap` (token level) each token carries its
    own factor c_t: gspo spreads the row's corrected objective evenly over its tokens (the gradient flows through
    the row's mean log ratio: AReaL's sequence-level form); gspo_token gives token t its own c_t (verl's form).
    Same value, same gradient summed over a row, different split within it."""
    plain = _gspo_pair_grads(None)
    assert plain["gspo"][0] == pytest.approx(plain["gspo_token"][0], abs=1e-7)
    np.testing.assert_allclose(plain["gspo"][1], plain["gspo_token"][1], atol=1e-7)
    tis = _gspo_pair_grads(1.5)
    assert tis["gspo"][0] == pytest.approx(tis["gspo_token"][0], abs=1e-7)
    g, gt = tis["gspo"][1], tis["gspo_token"][1]
    np.testing.assert_allclose(g.sum(axis=1), gt.sum(axis=1), atol=1e-6)
    np.testing.assert_allclose(g[0], np.full(3, g[0].mean()), atol=1e-7)  # gspo: one gradient for the row
    assert np.ptp(gt[0]) > 0.05, gt[0]  # gspo_token: each token its own, truncated where w_t > 1.5
    np.testing.assert_allclose(g[0], [-0.1780, -0.1780, -0.1780], atol=1e-4)
    np.testing.assert_allclose(gt[0], [-0.1842, -0.2486, -0.1011], atol=1e-4)
