"""The collector (`orchestration/collect.py`): the staleness and zero-variance filters on hand-built groups, and
its timeout."""

from __future__ import annotations

import queue

import numpy as np
import pytest

from asyncrl.orchestration.collect import RolloutTimeout, collect_rollouts
from asyncrl.orchestration.staleness import Staleness
from asyncrl.rollout import Rollout
from tests.helpers import make_rollout


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
