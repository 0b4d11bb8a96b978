"""`agent.branches: keep`: every branch of an agent's session is trained as its own trajectory, so a group holds
more rows than its episodes, and a varying number. The step's batch keeps its fixed shape: each group takes
`inference.group_size + agent.branch_rows` rows, filled with masked copies (`batch.build_batch(group_rows=...)`).
What must hold: the filler rows change nothing the loss, the update or the ESS sees; the runner chooses branches
within the rows; the config sizes the step in groups of those rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncrl.endpoint.agents import choose_branches
from asyncrl.models import Model, preset
from asyncrl.rollout import Completion
from asyncrl.train.advantages import prepare_loss_inputs
from asyncrl.train.batch import build_batch, offset_group_ids
from asyncrl.train.config import MeshConfig, ShardingConfig, TrainConfig
from asyncrl.train.loss_config import LossConfig
from asyncrl.train.registry import LOSSES
from asyncrl.train.trainer import Trainer
from asyncrl.validate import ConfigError
from tests.helpers import make_rollouts, random_params

VOCAB = 64


def variable_groups(sizes: list[int], seed: int = 0):
    """Groups of the given sizes (a kept branch is one more completion of its prompt), rewards varied."""
    groups = make_rollouts(seed, len(sizes), max(sizes), VOCAB, max_new=8)
    rng = np.random.default_rng(seed + 1)
    for r, n in zip(groups, sizes):
        r.completions = r.completions[:n]
        for c in r.completions:
            c.reward = float(rng.integers(0, 3))
    return groups


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("filter_zero_variance", [False, True])
def test_filler_rows_change_no_advantage_and_no_weight(name, filter_zero_variance):
    cfg = LossConfig(name=name, max_tokens=16, filter_zero_variance=filter_zero_variance)
    groups = variable_groups([6, 4, 5, 4])
    plain = build_batch(groups, cfg, pad_to_multiple=8)
    padded = build_batch(groups, cfg, pad_to_multiple=8, group_rows=6)
    assert padded.tokens.shape == (24, plain.tokens.shape[1]) and plain.tokens.shape[0] == 19
    real = padded.group_ids >= 0
    assert real.sum() == 19 and not padded.loss_mask[~real].any()
    assert len(set(padded.group_ids[~real].tolist())) == 5  # each filler its own group, none a real group's
    for f in ("tokens", "seq_lens", "rewards", "group_ids", "loss_mask", "sampler_logprobs"):
        np.testing.assert_array_equal(getattr(padded, f)[real], getattr(plain, f))
    adv_p, w_p = prepare_loss_inputs(*map(jnp.asarray, (plain.rewards, plain.group_ids, plain.loss_mask)), cfg)
    adv, w = prepare_loss_inputs(*map(jnp.asarray, (padded.rewards, padded.group_ids, padded.loss_mask)), cfg)
    np.testing.assert_array_equal(np.asarray(adv)[real], np.asarray(adv_p))
    np.testing.assert_array_equal(np.asarray(adv)[~real], 0.0)
    np.testing.assert_allclose(np.asarray(w)[real], np.asarray(w_p), rtol=1e-6, atol=0)
    assert not np.asarray(w)[~real].any()
    with pytest.raises(ValueError, match=r"groups \[\('s0', 6\)\] have more completions than group_rows=5"):
        build_batch(groups, cfg, group_rows=5)


def test_a_step_on_filler_rows_is_the_step_without_them():
    """One optimizer step (GRPO, proximal pass, ESS sums) on the padded batch equals the step on the same groups
    unpadded: same updated weights (to float rounding of sums over more zeros), same loss, same per-group ESS."""
    groups = variable_groups([6, 4, 5, 4], seed=3)
    cfg = LossConfig(name="grpo")
    single = ShardingConfig(mesh=MeshConfig(dp=1, fsdp=1))
    out = {}
    for rows, batch in ((19, build_batch(groups, cfg, 8)), (24, build_batch(groups, cfg, 8, group_rows=6))):
        t = Trainer(Model(preset("tiny")), TrainConfig(train_batch_size=rows, lr=3e-3), cfg, single,
                    devices=jax.devices()[:1])
        t.load(random_params(preset("tiny")))
        metrics = t.step(batch)
        out[rows] = (jax.tree.map(np.asarray, t.params), metrics, t.group_weights[:4])
    (p19, m19, gw19), (p24, m24, gw24) = out[19], out[24]
    p0 = jax.tree.map(np.asarray, random_params(preset("tiny")))
    d19, d24 = (np.concatenate([(a - b).ravel() for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(p0))])
                for p in (p19, p24))
    # AdamW's first update is about lr * sign(g): an element whose gradient is near 0 can flip with the rounding
    # of sums over more (zero) terms, so the update is compared as a whole, not element by element.
    assert np.linalg.norm(d19) > 0.1  # the step did update the weights
    assert np.linalg.norm(d24 - d19) <= 1e-5 * np.linalg.norm(d19), np.linalg.norm(d24 - d19)
    for key in ("train/loss", "train/grad_norm"):
        np.testing.assert_allclose(m24[key], m19[key], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(gw24, gw19, rtol=1e-5)


def test_filler_ids_stay_unique_across_hosts():
    a = np.array([0, 0, 1, -3, -4], np.int32)
    both = np.concatenate([offset_group_ids(a, 0), offset_group_ids(a, 5)])
    np.testing.assert_array_equal(both, [0, 0, 1, -3, -4, 5, 5, 6, -8, -9])
    dense = np.array([0, 0, 1, 1], np.int32)
    np.testing.assert_array_equal(offset_group_ids(dense, 4), dense + 4)  # no filler: today's offset


def _branch(tag: int) -> tuple[np.ndarray, Completion]:
    return np.array([1, tag], np.int32), Completion(tokens=np.array([tag], np.int32), logprobs=np.zeros(1, np.float32),
                                                    forced=np.zeros(1, bool), versions=np.zeros(1, np.int32))


def test_branches_chosen_within_the_group_rows():
    def episodes():  # branches tagged episode*10 + branch; the last branch of each is the one the agent ended on
        return [[_branch(e * 10 + b) for b in range(n)] for e, n in enumerate([3, 1, 2, 1])]

    tags = lambda chosen: [int(c.tokens[0]) for _, c in chosen]  # noqa: E731
    drop = choose_branches(episodes(), 0)  # agent.branches=drop: each episode's last branch
    assert tags(drop) == [2, 10, 21, 30]
    assert drop[0][1].env_info == [{"dropped_branches": 2}] and drop[2][1].env_info == [{"dropped_branches": 1}]
    assert tags(choose_branches(episodes(), 3)) == [0, 1, 2, 10, 20, 21, 30]  # all fit
    two = choose_branches(episodes(), 2)  # one too many: the earliest branch of the episode holding the most goes
    assert tags(two) == [1, 2, 10, 20, 21, 30] and two[1][1].env_info == [{"dropped_branches": 1}]
    assert tags(choose_branches(episodes(), 1)) == [2, 10, 20, 21, 30]


def test_keep_sizes_the_step_in_groups_of_its_rows():
    from asyncrl.config.loader import load_config

    source = "task.sources=[{environment: agent, options: {task: digits}}]"
    cfg = load_config("default", [source, "agent.fn=m:run", "agent.branches=keep", "agent.branch_rows=8",
                                  "train.train_batch_size=64", "inference.group_size=8"])
    assert cfg.group_rows == 16 and cfg.prompts_per_step == 4
    assert cfg.trainer_role().group_rows == 16 and cfg.trainer_role().prompts_per_step == 4
    assert cfg.driver_config().prompts_per_step == 4
    assert load_config("default", [source, "agent.fn=m:run"]).trainer_role().group_rows is None  # drop: as before
    assert load_config("default", ["agent.branches=keep"]).group_rows == 8  # no agent source: nothing to keep
    with pytest.raises(ConfigError, match=r"train.train_batch_size=64 is invalid: must be a multiple of "
                                          r"inference.group_size \+ agent.branch_rows = 12"):
        load_config("default", [source, "agent.fn=m:run", "agent.branches=keep", "agent.branch_rows=4",
                                "train.train_batch_size=64", "inference.group_size=8"])
    with pytest.raises(ConfigError, match=r"agent.branch_rows=0 is invalid: must be >= 1 with agent.branches=keep"):
        load_config("default", [source, "agent.fn=m:run", "agent.branches=keep", "agent.branch_rows=0"])
