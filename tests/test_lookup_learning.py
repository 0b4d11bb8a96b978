"""Multi-turn RL end to end, in one process: the tiny model learns the lookup task (`envs/lookup.py`), whose reward
can only be reached through its environment, from chance (1 in 26) to above 0.9, with the real engine (episodes,
the park store, extends), the task's environment and verifier, and the trainer; and its action rate rises."""

from __future__ import annotations

import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncrl.envs import Environments, Source
from asyncrl.envs.lookup import ENVIRONMENT, LookupTask
from asyncrl.inference.config import InferenceConfig
from asyncrl.inference.engine import Engine, Request
from asyncrl.models import Model, preset
from asyncrl.models.tokenizer import Tokenizer, build_char_tokenizer
from asyncrl.orchestration.collect import collect_rollouts
from asyncrl.orchestration.staleness import Staleness
from asyncrl.rollout import Prompt
from asyncrl.tasks import Verifier, VerifierConfig
from asyncrl.train.batch import build_batch
from asyncrl.train.config import MeshConfig, ShardingConfig, TrainConfig
from asyncrl.train.loss_config import LossConfig
from asyncrl.train.trainer import Trainer
from asyncrl.train.warmstart import format_warmstart

PROMPTS, GROUP = 16, 8


def _evaluate(engine, envs, samples, n=2):
    reqs = []
    for i, s in enumerate(samples):
        ids, e = envs.open(s, n)
        reqs.append(Request(Prompt.for_eval(i, s, n, 0), ids, e))
    out = engine.generate(reqs)
    comps = [c for r in out for c in r.completions]
    return float(np.mean([c.reward for c in comps])), float(np.mean([c.n_turns > 1 for c in comps]))


@pytest.mark.slow
def test_rl_learns_to_use_the_lookup_action(tmp_path):
    tok = Tokenizer.from_folder(build_char_tokenizer(str(tmp_path / "tok")))
    cfg = preset("tiny")
    model = Model(cfg)
    task = LookupTask(eval_size=256)  # ~10 prompts a letter: the copy is learned letter by letter
    verifier = Verifier(task, VerifierConfig(mode="exact", workers=0))
    envs = Environments([Source(task, ENVIRONMENT)], tok, verifier, chat=False, step_timeout_s=30)
    loss_cfg = LossConfig(name="grpo", max_tokens=21)
    train_cfg = TrainConfig(train_batch_size=PROMPTS * GROUP, lr=2e-3, total_steps=600, pad_to_multiple=16,
                            warmup_steps=5, max_grad_norm=1.0)
    trainer = Trainer(model, train_cfg, loss_cfg, ShardingConfig(mesh=MeshConfig(dp=1, fsdp=1)),
                      devices=jax.devices()[:1])
    # Format warm-start: half the examples look up, half answer at once, every answer random (format, not rule).
    start = format_warmstart(model, model.init_params(jax.random.PRNGKey(0)), tok, task, 150, lr=3e-3, seed=0)
    trainer.load(start)
    icfg = InferenceConfig(group_size=GROUP, max_decode_batch_size=32, max_prefill_prompts=8, max_seq_len=32,
                           min_prefill_bucket=16, temperature=1.0, params_dtype="float32", kv_cache_dtype="float32",
                           max_turns=3, max_new_tokens=6)
    engine = Engine(model, start, icfg, tok, seed=0)
    eval_samples = list(task.samples("eval", 0))
    before, action_before = _evaluate(engine, envs, eval_samples)

    stream = task.samples("train", 0)
    rewards, actions = [], []
    for step in range(train_cfg.total_steps):
        reqs = []
        for p, s in zip(range(step * PROMPTS, (step + 1) * PROMPTS), itertools.islice(stream, PROMPTS)):
            ids, e = envs.open(s, GROUP)
            reqs.append(Request(Prompt(p, s, GROUP), ids, e))
        groups = iter(engine.generate(reqs))
        kept, host = collect_rollouts(lambda t: next(groups), PROMPTS, trainer.version, Staleness(0))
        metrics = trainer.step(build_batch(kept, loss_cfg, train_cfg.pad_to_multiple), host)
        # A host copy: the trainer's arrays carry its Explicit mesh, which the unsharded engine does not use.
        engine.set_params(jax.tree.map(np.asarray, trainer.params_for_inference(jnp.float32)), trainer.version)
        rewards.append(metrics["rollout/reward_mean"])
        actions.append(metrics["rollout/multi_turn_share"])
        if step == 0:
            assert metrics["train/is_ratio_min"] == pytest.approx(1.0, abs=1e-3)  # token-exact: on-policy ratios 1
            assert metrics["rollout/observation_share"] > 0 and metrics["rollout/turns_mean"] > 1
        # Trained until the policy is above the bar with a margin, over 20 steps (2560 samples). A stop on a 5-step
        # streak left a policy near 0.93, which a 128-sample eval of 64 prompts (2 or 3 a letter, and the copy is
        # learned letter by letter) put at 0.875 once in CI. Now: 512 samples of 256 prompts; measured here, seeds
        # 0, 1, 2: 0.945, 0.928, 0.963.
        if len(rewards) >= 20 and np.mean(rewards[-20:]) >= 0.96:
            break
    after, action_after = _evaluate(engine, envs, eval_samples)
    assert before <= 0.1, before  # a guess is right 1 time in 26
    assert after >= 0.9, (after, len(rewards), rewards[-10:])
    assert action_after > action_before and action_after > 0.9, (action_before, action_after)


@pytest.mark.slow
def test_three_hosts_with_max_lag_2_train_multi_turn_episodes(tmp_path):
    """`python launch.py --config-name lookup` on 3 simulated hosts (1 trainer, 2 inference), max_lag 2: every step
    once, multi-turn episodes in the metrics and in `rollouts.jsonl`, no trained sample staler than 2, and the data
    stream accounted for (nothing trained twice, nothing lost)."""
    from tests.helpers import check_data_positions, launch, rows

    run_dir = str(tmp_path / "run")
    res = launch(run_dir, "--config-name", "lookup", "run.hosts=3", "async.max_lag=2", "train.total_steps=8",
                 "train.format_warmstart_steps=60", "train.train_batch_size=64", "eval.every_n_steps=4",
                 "eval.num_prompts=16", "checkpoint.every_n_steps=4", "checkpoint.resume=false",
                 "logging.rollouts_every_n_steps=1")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    r = rows(run_dir)
    assert [x["step"] for x in r] == list(range(1, 9))
    assert all(x["rollout/lag_max"] <= 2 for x in r)
    assert all(x["rollout/turns_mean"] > 1 and x["rollout/observation_share"] > 0 for x in r)
    for key in ("rollout/multi_turn_share", "rollout/env_step_s_mean", "rollout/ended_max_turns"):
        assert all(key in x for x in r), key
    check_data_positions(run_dir, steps=8, groups_per_step=8)
    with open(f"{run_dir}/rollouts.jsonl") as f:
        logged = [json.loads(x) for x in f if x.strip()]
    turns = [c for g in logged if "completions" in g for c in g["completions"] if "turns" in c]
    assert turns and all(len(c["turns"]) >= 2 and c["observation_tokens"] > 0 for c in turns)
    assert any(t.startswith("?") for c in turns for t in c["turns"][:1])  # the lookup action, as sampled
