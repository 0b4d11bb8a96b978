"""End to end on the tiny model: RL on its own samples drives a synthetic reward from chance to > 0.9.

Reward 1 iff the completion's first token is TARGET (chance 1/128). Samples come from a jitted ancestral sampler
written here (no inference engine); their logprobs go through `build_batch` as the sampler logprobs, so the first
step's importance ratios being 1 also checks that trainer and sampler logprobs are aligned token for token.
"""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncrl.models import Model, preset
from asyncrl.orchestration.collect import collect_rollouts
from asyncrl.orchestration.staleness import Staleness
from asyncrl.rollout import Completion, Prompt, Rollout
from asyncrl.train.batch import build_batch
from asyncrl.train.config import MeshConfig, ShardingConfig, TrainConfig
from asyncrl.train.loss_config import LossConfig
from asyncrl.train.trainer import Trainer
from tests.helpers import random_params

PROMPTS, GROUP, PROMPT_LEN, NEW, TARGET = 8, 8, 3, 2, 7


def make_sampler(model: Model):
    @jax.jit
    def sample(params, prompts: jax.Array, key: jax.Array) -> tuple[jax.Array, jax.Array]:
        """prompts [B, P] -> (tokens [B, NEW], logprobs [B, NEW]) at temperature 1, one full forward per token."""
        B = prompts.shape[0]
        buf = jnp.concatenate([prompts, jnp.zeros((B, NEW), jnp.int32)], axis=1)  # [B, P + NEW]

        def body(i, carry):
            buf, lps, key = carry
            key, sub = jax.random.split(key)
            logits, _ = model.apply(params, buf, jnp.full((B,), PROMPT_LEN + i))  # [B, P + NEW, V]
            logits = jax.lax.dynamic_index_in_dim(logits, PROMPT_LEN + i - 1, axis=1, keepdims=False)  # [B, V]
            tok = jax.random.categorical(sub, logits).astype(jnp.int32)
            lp = jnp.take_along_axis(jax.nn.log_softmax(logits), tok[:, None], axis=1)[:, 0]
            buf = jax.lax.dynamic_update_index_in_dim(buf, tok[:, None], PROMPT_LEN + i, axis=1)
            return buf, lps.at[:, i].set(lp), key

        buf, lps, _ = jax.lax.fori_loop(0, NEW, body, (buf, jnp.zeros((B, NEW), jnp.float32), key))
        return buf[:, PROMPT_LEN:], lps

    return sample


def _rollouts(prompts: np.ndarray, tokens: np.ndarray, logprobs: np.ndarray, version: int) -> list[Rollout]:
    out = []
    for p in range(len(prompts)):
        rows = range(p * GROUP, (p + 1) * GROUP)
        out.append(Rollout(
            prompt=Prompt(p, SimpleNamespace(id=str(p), answer=str(TARGET)), GROUP), prompt_tokens=prompts[p],
            completions=[Completion(tokens=tokens[r], logprobs=logprobs[r], forced=np.zeros(NEW, bool),
                                    versions=np.full(NEW, version, np.int32), reward=float(tokens[r, 0] == TARGET))
                         for r in rows]))
    return out


# name -> (loss config, updates per step). Epsilons and caps as in the presets.
CASES = {
    "grpo": (LossConfig(name="grpo"), 1),
    "cispo": (LossConfig(name="cispo", epsilon_high=1.0), 1),
    "gspo": (LossConfig(name="gspo", epsilon_low=3e-4, epsilon_high=4e-4), 1),
    # Two updates per batch: the second clips against the proximal policy; token TIS corrects sampler -> proximal.
    "grpo_2_updates_tis": (LossConfig(name="grpo", is_mode="truncate", tis_cap=2.0), 2),
}


@pytest.mark.parametrize("case", ["grpo", pytest.param("cispo", marks=pytest.mark.slow), "gspo",
                                  "grpo_2_updates_tis"])
def test_rl_learns_synthetic_reward(case):
    cfg = preset("tiny")
    model = Model(cfg)
    loss_cfg, updates = CASES[case]
    train_cfg = TrainConfig(train_batch_size=PROMPTS * GROUP, lr=3e-3, total_steps=300, pad_to_multiple=8,
                            updates_per_step=updates)
    trainer = Trainer(model, train_cfg, loss_cfg, ShardingConfig(mesh=MeshConfig(dp=1, fsdp=1)),
                      devices=jax.devices()[:1])
    trainer.load(random_params(cfg))
    sample = make_sampler(model)
    rng, key = np.random.default_rng(0), jax.random.key(1)
    rewards: list[float] = []
    for step in range(train_cfg.total_steps):
        prompts = rng.integers(1, cfg.vocab_size, (PROMPTS, PROMPT_LEN)).astype(np.int32)
        key, sub = jax.random.split(key)
        # A host copy: the trainer's arrays carry its Explicit mesh, which the unsharded sampler does not use.
        params = jax.tree.map(np.asarray, trainer.params)
        tokens, logprobs = jax.tree.map(np.asarray, sample(params, jnp.asarray(np.repeat(prompts, GROUP, 0)), sub))
        stream = iter(_rollouts(prompts, tokens, logprobs, trainer.version))
        groups, host = collect_rollouts(lambda timeout: next(stream), PROMPTS, trainer.version, Staleness(0))
        metrics = trainer.step(build_batch(groups, loss_cfg, train_cfg.pad_to_multiple), host)
        if step == 0:
            # On-policy: trainer and sampler logprobs agree, so every importance ratio is 1 (with several updates,
            # the ratio to the proximal policy moves after the first; the proximal/sampler weight is then 1).
            ratio = "train/is_weight" if updates > 1 else "train/is_ratio"
            assert metrics[ratio + "_min"] == pytest.approx(1.0, abs=1e-4)
            assert metrics[ratio + "_max"] == pytest.approx(1.0, abs=1e-4)
            assert metrics["rollout/lag_max"] == 0
        rewards.append(metrics["rollout/reward_mean"])
        if len(rewards) >= 5 and np.mean(rewards[-5:]) > 0.9:
            break
    assert np.mean(rewards[:3]) < 0.1, rewards[:3]  # started near chance (1/128)
    assert np.mean(rewards[-5:]) > 0.9, f"reward after {len(rewards)} steps: {rewards[-10:]}"
    assert trainer.compiled_step_count() == 1  # fixed padded length -> one program
