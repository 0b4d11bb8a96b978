"""`logging.rollout_tokens` (`asyncrl/orchestration/rollout_log.py`): the audit trail. Each logged completion keeps
its token ids, sampler logprobs, forced and observation marks, versions and turns, so that a run's rollouts.jsonl
and its saved weights alone show that the trainer scores what the sampler sampled."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from asyncrl.orchestration import rollout_log
from asyncrl.orchestration.config import LoggingConfig
from asyncrl.rollout import Completion, Prompt, Rollout
from asyncrl.validate import ConfigError


def _completions(path: str) -> list[tuple[dict, dict]]:
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [(r, c) for r in records if "completions" in r for c in r["completions"]]


def test_the_token_arrays_round_trip_exactly(tmp_path):
    rng = np.random.default_rng(0)
    n = 9
    obs = np.zeros(n, bool)
    obs[3:5] = True
    c = Completion(tokens=rng.integers(0, 500, n).astype(np.int32),
                   logprobs=np.where(obs, 0, -rng.random(n) * 5).astype(np.float32), forced=obs | (np.arange(n) == 8),
                   versions=np.array([3] * 6 + [4] * 3, np.int32), prompt_version=3,
                   turns=np.array([0, 0, 0, 0, 0, 1, 1, 1, 1], np.int32), observation=obs, text="x")
    r = Rollout(Prompt(7), np.array([5, 6, 7], np.int32), [c, Completion(np.zeros(0, np.int32),
                np.zeros(0, np.float32), np.zeros(0, bool), np.zeros(0, np.int32))])
    path = str(tmp_path / "rollouts.jsonl")
    rollout_log.log_rollouts(path, 1, 4, [r], [], tokens=True)
    rollout_log.log_rollouts(path, 2, 4, [r], [])  # off: the record as before
    (rec, got), (_, empty), (plain_rec, plain), _ = _completions(path)
    t = got["tokens"]
    assert rec["prompt_ids"] == [5, 6, 7]
    assert t["ids"] == c.tokens.tolist() and t["versions"] == c.versions.tolist() and t["turns"] == c.turns.tolist()
    assert np.array_equal(np.asarray(t["logprobs"], np.float32), c.logprobs)  # bit for bit, float32
    assert t["forced"] == c.forced.astype(int).tolist() and t["observation"] == obs.astype(int).tolist()
    assert empty["tokens"] == {k: [] for k in t}
    assert "tokens" not in plain and "prompt_ids" not in plain_rec


def test_rollout_tokens_needs_the_rollouts_it_adds_to():
    with pytest.raises(ConfigError, match="logging.rollout_tokens"):
        LoggingConfig(rollout_tokens=True)
    assert LoggingConfig(rollout_tokens=True, rollouts_every_n_steps=1).rollout_tokens


def _params(run_dir: str, where: str, step: int):
    """The weights a run saved: a trainer checkpoint (`checkpoints/N`, version N) or the KL reference
    (`reference/0`, the starting policy, version 0), as the model's Params."""
    import orbax.checkpoint as ocp

    from asyncrl.models.params import LayerParams, Params

    mgr = ocp.CheckpointManager(os.path.join(run_dir, where), item_names=("state", "meta"))
    out = mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore()))
    mgr.close()
    p = out["state"]["params"]
    return Params(**{**p, "layers": LayerParams(**p["layers"])}), int(out["meta"].get("version", 0))


def _rescored(model, params, items: list[tuple[dict, dict]]) -> list[np.ndarray]:
    """Teacher-forced logprobs of each completion's tokens (the trainer's `get_logprobs`, at temperature 1)."""
    import jax
    import jax.numpy as jnp

    seqs = [r["prompt_ids"] + c["tokens"]["ids"] for r, c in items]
    width = max(map(len, seqs))
    toks = np.zeros((len(seqs), width), np.int32)
    for i, s in enumerate(seqs):
        toks[i, :len(s)] = s
    lens = np.asarray([len(s) for s in seqs], np.int32)
    lp = np.asarray(jax.jit(model.get_logprobs, static_argnums=3)(params, jnp.asarray(toks), jnp.asarray(lens), 1.0))
    # Completion token i sits at position len(prompt) + i, predicted from the position before it.
    return [lp[i, len(r["prompt_ids"]) - 1:len(r["prompt_ids"]) - 1 + len(c["tokens"]["ids"])]
            for i, (r, c) in enumerate(items)]


@pytest.mark.slow
def test_a_runs_logprobs_recompute_from_its_files_alone(tmp_path):
    """A real multi-turn run (the lookup task: observations between model turns) at max_lag 0, its weights saved
    at every version: rescoring each completion from rollouts.jsonl with the weights of its version gives the
    sampler's logprobs at every sampled token (fp32, within 1e-4), observations marked, and the wrong version's
    weights do not."""
    from omegaconf import OmegaConf

    from asyncrl.models.sources import model_config
    from asyncrl.models.transformer import Model
    from tests.helpers import launch

    run_dir = str(tmp_path / "run")
    # kl_coef > 0 with checkpoints: the run saves its starting policy (version 0) in run_dir/reference.
    res = launch(run_dir, "--config-name", "lookup", "async.max_lag=0", "train.total_steps=2",
                 "train.format_warmstart_steps=60", "train.train_batch_size=32", "eval.every_n_steps=0",
                 "checkpoint.every_n_steps=1", "checkpoint.keep=2", "checkpoint.resume=false", "loss.kl_coef=0.001",
                 "logging.rollouts_every_n_steps=1", "logging.rollout_tokens=true", "logging.progress=false")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    cfg = OmegaConf.load(os.path.join(run_dir, "config.yaml"))
    assert cfg.inference.params_dtype == "float32" and cfg.inference.temperature == 1.0
    model = Model(model_config(cfg.model))
    weights = {v: p for p, v in (_params(run_dir, "reference", 0), _params(run_dir, "checkpoints", 1),
                                 _params(run_dir, "checkpoints", 2))}
    assert sorted(weights) == [0, 1, 2]

    items = _completions(os.path.join(run_dir, "rollouts.jsonl"))
    by_version: dict[int, list] = {}
    for r, c in items:
        t = c["tokens"]
        n = len(t["ids"])
        assert all(len(t[k]) == n for k in ("logprobs", "forced", "observation", "versions", "turns")), t
        assert len(set(t["versions"])) == 1 and c["prompt_version"] == t["versions"][0] == r["trainer_version"]
        obs = np.asarray(t["observation"], bool)
        assert np.all(np.asarray(t["forced"], bool)[obs]) and np.all(np.asarray(t["logprobs"])[obs] == 0)
        by_version.setdefault(t["versions"][0], []).append((r, c))
    assert sorted(by_version) == [0, 1]  # step 1 from the start, step 2 from the first update
    n_obs = sum(sum(c["tokens"]["observation"]) for _, c in items)
    assert n_obs > 0 and sum(max(c["tokens"]["turns"]) > 0 for _, c in items) > 0  # multi-turn episodes

    worst, sampled = 0.0, 0
    for version, group in by_version.items():
        for (_, c), lp in zip(group, _rescored(model, weights[version], group), strict=True):
            t = c["tokens"]
            keep = ~np.asarray(t["forced"], bool)
            diff = np.abs(lp[keep] - np.asarray(t["logprobs"], np.float32)[keep])
            worst, sampled = max(worst, float(diff.max(initial=0.0))), sampled + int(keep.sum())
    print(f"audit: {len(items)} completions, {sampled} sampled tokens, {n_obs} observation tokens, "
          f"max |diff| {worst:.2e}")
    assert sampled > 0 and worst <= 1e-4, worst
    # The check can tell versions apart: the first update's completions under the start's or the next weights.
    group = by_version[1]
    for other in (0, 2):
        lp = _rescored(model, weights[other], group)
        off = max(float(np.abs(x - np.asarray(c["tokens"]["logprobs"]))[~np.asarray(c["tokens"]["forced"], bool)]
                        .max(initial=0.0)) for x, (_, c) in zip(lp, group, strict=True))
        assert off > 1e-3, (other, off)
