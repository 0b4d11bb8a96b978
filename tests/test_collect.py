"""The collector (`orchestration/collect.py`): the staleness and zero-variance filters on hand-built groups, and
its timeout; in the simulated loop (`helpers.Sim`), no lag drops when inference is fast, oldest-first pooling and
the zero-variance filter's credit; the zero-variance budget, the bounded straggler wait and rate-limited warnings."""

from __future__ import annotations

import queue
import time

import numpy as np
import pytest

from asyncrl.orchestration.collect import RolloutTimeout, collect_rollouts
from asyncrl.orchestration.staleness import Staleness
from asyncrl.rollout import Rollout
from tests.helpers import FakeQueue, Sim, group, make_rollout


def _queue_of(rollouts: list[Rollout]):
    q: queue.Queue = queue.Queue()
    for r in rollouts:
        q.put(r)
    return lambda timeout: q.get(timeout=timeout)


def test_collect_filters_stale_and_zero_variance_groups():
    rng = np.random.default_rng(0)
    version, max_lag = 10, 2
    mk = lambda uid, rewards, oldest: make_rollout(rng, uid, 3, 50, 4, 6, rewards, version=version,  # noqa: E731
                                                     oldest_version=oldest)
    stream = [
        mk(0, [1.0, 0.0, 0.0], 10),  # fresh, mixed rewards: kept (lag 0)
        mk(1, [1.0, 0.0, 1.0], 7),  # lag 3 > 2: dropped for lag
        mk(2, [1.0, 1.0, 1.0], 9),  # all equal: dropped as zero-variance
        mk(3, [0.0, 0.0, 0.0], 5),  # stale *and* equal: counted once, as lag
        mk(4, [0.0, 1.0, 0.0], 8),  # lag exactly max_lag: kept
        mk(5, [1.0, 0.0, 1.0], 10),  # never read: the collector stops at n_groups
    ]
    ticks = iter([100.0, 103.5])
    kept, m = collect_rollouts(_queue_of(stream), n_groups=2, version=version, staleness=Staleness(max_lag),
                               drop_zero_variance=True, timeout_s=1.0, clock=lambda: next(ticks))
    assert [r.prompt.position for r in kept] == [0, 4]
    assert m["rollout/filtered_lag"] == 2 and m["rollout/filtered_zero_variance"] == 1
    assert (m["rollout/lag_min"], m["rollout/lag_max"], m["rollout/lag_mean"]) == (0, 2, 1)
    assert m["rollout/queue_wait_s_max"] == pytest.approx(3.5)
    assert m["rollout/reward_mean"] == pytest.approx(2 / 6)
    lens = [len(c.tokens) for r in kept for c in r.completions]
    assert m["rollout/completion_len_mean"] == pytest.approx(np.mean(lens))
    # uid 4's completions (oldest 8, newest 10) changed version mid-completion when they have 2+ tokens.
    assert m["rollout/in_flight_updated"] == sum(len(c.tokens) > 1 for c in kept[1].completions)
    assert m["rollout/in_flight_updated"] > 0


def test_a_group_with_no_prompt_ids_is_dropped_as_failed_and_credited():
    """Every episode of an agent group failed before its first call: the group has no prompt ids and no completion
    ids. Admitted, it would stop the trainer in build_batch ("empty prompt"); it is dropped and credited instead."""
    from asyncrl.rollout import Completion, Prompt

    rng = np.random.default_rng(2)
    empty = lambda: Completion(np.zeros(0, np.int32), np.zeros(0, np.float32), np.zeros(0, bool),  # noqa: E731
                               np.zeros(0, np.int32), reward=0.0)
    failed = Rollout(Prompt(0, None, 2), np.zeros(0, np.int32), [empty(), empty()])
    stream = [failed, make_rollout(rng, 1, 2, 50, 3, 4, [1.0, 0.0])]
    consumed = []
    kept, m = collect_rollouts(_queue_of(stream), n_groups=1, version=0, staleness=Staleness(2), timeout_s=1.0,
                               on_consumed=lambda r, reason: consumed.append((r.prompt.position, reason)))
    assert [r.prompt.position for r in kept] == [1]
    assert m["rollout/filtered_failed"] == 1 and m["rollout/filtered_lag"] == 0
    assert consumed == [(0, "failed"), (1, None)]


def test_collect_keeps_zero_variance_groups_unless_asked():
    rng = np.random.default_rng(1)
    stream = [make_rollout(rng, i, 2, 50, 3, 4, [1.0, 1.0]) for i in range(2)]
    kept, m = collect_rollouts(_queue_of(stream), n_groups=2, version=0, staleness=Staleness(0), timeout_s=1.0)
    assert len(kept) == 2 and m["rollout/filtered_zero_variance"] == 0


def test_collect_times_out_with_a_message():
    rng = np.random.default_rng(2)
    get = _queue_of([make_rollout(rng, 0, 2, 50, 3, 4, [1.0, 0.0], version=0)])
    with pytest.raises(RolloutTimeout, match=r"trainer-0 waited .* 1/3 groups for version 5"):
        collect_rollouts(get, n_groups=3, version=5, staleness=Staleness(8), timeout_s=0.01, who="trainer-0")
    with pytest.raises(RolloutTimeout):
        collect_rollouts(lambda t: None, n_groups=1, version=0, staleness=Staleness(0), timeout_s=0.01)


# ---- in the simulated loop (feeder -> fake inference -> collector), and its pool, budget and warnings --------

@pytest.mark.parametrize("max_lag", [1, 2])
def test_fast_inference_drops_nothing_for_lag(max_lag):
    # Inference is much faster than the trainer (the case where a step of slack made groups too stale).
    sim = Sim(P=4, max_lag=max_lag, rewards=lambda p: [p % 2, 1 - p % 2], step_s=0.05)
    metrics = sim.run(12)
    assert sum(m["rollout/filtered_lag"] for m in metrics) == 0
    assert max(m["rollout/lag_max"] for m in metrics) <= max_lag
    assert max(m["rollout/lag_max"] for m in metrics) == max_lag  # inference does run max_lag steps ahead
    positions = [p for _, p in sim.taken]
    assert len(positions) == len(set(positions)) == 48


@pytest.mark.parametrize("pooled", [True, False])
def test_out_of_order_groups_are_trained_oldest_first(pooled):
    """Four replicas, every third group slow: without the pool a step takes the next step's quick groups and its
    own stragglers come back too stale; with it (oldest first, waiting for urgent positions) nothing is lost."""
    sim = Sim(P=8, max_lag=1, rewards=lambda p: [p % 2, 1 - p % 2], replicas=4, step_s=0.01,
              decode_s=lambda p: 0.06 if p % 3 == 0 else 0.002, pooled=pooled)
    metrics = sim.run(10)
    lag_drops = sum(m["rollout/filtered_lag"] for m in metrics)
    if pooled:
        assert lag_drops == 0
        assert max(m["rollout/lag_max"] for m in metrics) <= 1
    else:
        assert lag_drops > 0  # the case the pool exists for (so the test above is not vacuous)
    positions = [p for _, p in sim.taken]
    assert len(positions) == len(set(positions)) == 80


@pytest.mark.parametrize("max_lag", [0, 1])
def test_zero_variance_filter_never_starves_the_trainer(max_lag):
    # 3 of every 4 groups are all-correct: DAPO's filter drops them, the credit replaces them at once.
    sim = Sim(P=4, max_lag=max_lag, rewards=lambda p: [1, 1] if p % 4 else [1, 0], drop_zero_variance=True)
    metrics = sim.run(5)
    assert sum(m["rollout/filtered_zero_variance"] for m in metrics) >= 3 * 20 - 4 * (max_lag + 1)
    assert all(p % 4 == 0 for _, p in sim.taken) and len(sim.taken) == 20
    if max_lag == 0:  # on-policy and deterministic: exactly the first 20 groups with variance, in order
        assert [p for _, p in sim.taken] == [4 * i for i in range(20)]


def test_zero_variance_budget_fills_the_step_instead_of_sampling_forever():
    stream = ([group(p, 0, [1, 1]) for p in range(7)] + [group(7, 0, [1, 0])]
              + [group(p, 0, [0, 0]) for p in range(8, 12)])
    q = FakeQueue()
    for r in stream:
        q.put(r)
    seen = []
    kept, m = collect_rollouts(q.poll, 4, 0, Staleness(0), drop_zero_variance=True, timeout_s=1, poll_s=0.05,
                               on_consumed=lambda r, reason: seen.append((r.prompt.position, reason)),
                               zero_variance_budget=5)
    # 5 dropped, then zero-variance groups fill the batch next to the one group with variance.
    assert m["rollout/filtered_zero_variance"] == 5 and m["rollout/zero_variance_fillers"] == 3
    assert [r.prompt.position for r in kept] == [5, 6, 7, 8]
    assert seen == [(p, "zero_variance") for p in range(5)] + [(p, None) for p in (5, 6, 7, 8)]
    import jax.numpy as jnp

    from asyncrl.train.advantages import keep_sequences
    from asyncrl.train.loss_config import LossConfig

    rewards = jnp.asarray([c.reward for r in kept for c in r.completions])
    ids = jnp.asarray([g for g, r in enumerate(kept) for _ in r.completions])
    keep = keep_sequences(rewards, ids, LossConfig(name="dapo", filter_zero_variance=True))
    assert keep.tolist() == [False] * 4 + [True] * 2 + [False] * 2  # the loss gives the fillers no weight


def test_straggler_wait_is_bounded():
    q = FakeQueue()
    for p in range(4):
        q.put(group(p, 1, [1, 0]))  # lag 0: fresher groups could still come, so the step may wait
    t0 = time.time()
    kept, m = collect_rollouts(q.poll, 3, 1, Staleness(1), timeout_s=30, poll_s=0.05, pool=(pool := []),
                               urgent=lambda v: {99}, straggler=0.3)  # 99 never comes
    assert 0.25 < time.time() - t0 < 5
    assert len(kept) == 3 and len(pool) == 1  # the 4th group is carried to the next step
    kept, m = collect_rollouts(q.poll, 1, 1, Staleness(1), timeout_s=30, poll_s=0.05, pool=pool,
                               urgent=lambda v: set())
    assert [r.prompt.position for r in kept] == [3] and not pool


def test_drop_warnings_are_rate_limited(monkeypatch, caplog):
    import logging

    import asyncrl.orchestration.collect as collect_mod

    monkeypatch.setattr(collect_mod, "_last_drop_warning", [float("-inf")])
    with caplog.at_level(logging.WARNING, logger="asyncrl.orchestration.collect"):
        for step in range(3):  # three steps, each dropping 15 too-stale groups before taking 1 fresh one
            q = FakeQueue()
            for p in range(15):
                q.put(group(100 * step + p, 0, [0.0, 1.0]))
            q.put(group(100 * step + 99, 5, [0.0, 1.0]))
            got, m = collect_rollouts(q.poll, 1, 5, Staleness(1), timeout_s=5, poll_s=0.01)
            assert m["rollout/filtered_lag"] == 15 and len(got) == 1
    said = [r.getMessage() for r in caplog.records if "groups so far" in r.getMessage()]
    assert len(said) == 1 and "dropped 10 groups so far for version 5" in said[0], said

