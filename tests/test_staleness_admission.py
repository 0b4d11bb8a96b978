"""Adaptive admission (`orchestration/staleness.py`: `Admission`, `Staleness.drop_reason`): the release gate
follows the measured ESS up to max_lag and back, groups from a lag under the ESS floor are dropped and credited,
and the fixed policy is the one it always was."""

import json
import time

import pytest

from asyncrl.orchestration.collect import collect_rollouts
from asyncrl.orchestration.config import AsyncConfig
from asyncrl.orchestration.feeder import Feeder
from asyncrl.orchestration.staleness import FLOOR_WINDOW, Admission, Staleness
from asyncrl.validate import ConfigError
from tests.helpers import FakeQueue, group, sample_stream, wait_until


def test_high_ess_grows_the_release_lag_up_to_max_lag_and_low_ess_shrinks_it():
    a = Admission(max_lag=3, ess_target=0.9)
    s = Staleness(3, a)
    assert s.release_limit(4, 0, 0) == 4  # starts on-policy: one step's prompts per synced version
    for step in range(1, 7):
        a.observe(step, {min(step - 1, 3): 0.95})
    assert a.ahead == 3 and s.release_limit(4, 0, 0) == 16  # capped at max_lag
    a.observe(7, {0: 0.99, 3: 0.6})  # the stalest groups decide, however fresh the others are
    assert a.ahead == 2
    for step in range(8, 12):
        a.observe(step, {2: 0.5})
    assert a.ahead == 0 and s.release_limit(4, 5, 2) == 4 * 6 + 2
    a.observe(12, {})  # a step that measured nothing changes nothing
    assert a.ahead == 0


def test_fixed_is_max_lag_ahead_and_drops_only_past_it():
    s = Staleness(2)
    assert s.ahead == 2 and s.release_limit(4, 1, 3, extra=1) == 4 * (1 + 2 + 1) + 3 + 1
    assert [s.drop_reason(5, group(0, v, [0, 1])) for v in (5, 3, 2)] == [None, None, "lag"]


def test_a_lag_under_the_floor_is_dropped_and_credited_until_its_figure_expires():
    a = Admission(max_lag=3, ess_target=0.9, ess_floor=0.5)
    s = Staleness(3, a)
    a.observe(4, {0: 0.97, 2: 0.3})  # step 4 trained lag-2 groups at ESS 0.3
    assert a.below_floor(2, 5) and not a.below_floor(0, 5) and not a.below_floor(1, 5)
    # Collecting step 5 (version 4): the lag-2 group is dropped for ESS, the lag-4 one for lag.
    stream = iter([group(0, 4, [0, 1]), group(1, 2, [0, 1]), group(2, 0, [0, 1]), group(3, 3, [1, 0])])
    credited = []
    kept, m = collect_rollouts(lambda t: next(stream), 2, 4, s, timeout_s=1.0,
                               on_consumed=lambda r, reason: credited.append((r.prompt.position, reason)))
    assert [r.prompt.position for r in kept] == [0, 3]
    assert sorted(credited) == [(0, None), (1, "ess"), (2, "lag"), (3, None)]
    assert m["rollout/filtered_ess"] == 1.0 and m["rollout/filtered_lag"] == 1.0
    # Nothing new measured at lag 2 while it is dropped: once its figure is FLOOR_WINDOW steps old, it is admitted
    # again (and measured again).
    assert not a.below_floor(2, 4 + FLOOR_WINDOW + 1)
    assert Staleness(3).drop_reason(4, group(1, 2, [0, 1])) is None  # fixed admission has no floor


def test_lag_0_is_never_dropped_for_ess_so_a_step_always_fills():
    """A lag-0 group's replacement would be lag 0 again: dropping it would stall the step for good (the figure
    ages by trained steps, and none would train)."""
    a = Admission(max_lag=2, ess_target=0.9, ess_floor=0.6)
    a.observe(3, {0: 0.55, 1: 0.4})
    assert not a.below_floor(0, 4) and a.below_floor(1, 4)
    s = Staleness(2, a)
    stream = iter([group(0, 3, [0, 1]), group(1, 3, [1, 0])])
    kept, _ = collect_rollouts(lambda t: next(stream), 2, 3, s, timeout_s=1.0)
    assert [r.prompt.position for r in kept] == [0, 1]


def test_admission_state_round_trips_through_checkpoint_meta():
    a = Admission(max_lag=3, ess_target=0.9, ess_floor=0.5)
    for step in range(1, 4):
        a.observe(step, {0: 0.99, step - 1: 0.3 + 0.2 * step})
    meta = json.loads(json.dumps(a.state()))  # as the checkpoint meta stores it
    b = Admission(max_lag=3, ess_target=0.9, ess_floor=0.5)
    b.restore(meta)
    assert (b.ahead, b.floor_ess) == (a.ahead, a.floor_ess)
    assert [b.below_floor(lag, 4) for lag in range(4)] == [a.below_floor(lag, 4) for lag in range(4)]


def test_an_ess_drop_is_credited_like_a_lag_drop():
    q = FakeQueue(100)
    f = Feeder(sample_stream, q.put, prompts_per_step=2, staleness=Staleness(0), group_size=2, poll_s=0.001)
    f.set_synced(0)
    f.start()
    try:
        assert wait_until(lambda: q.qsize() == 2)
        f.consumed(0, "ess")  # one more prompt goes out, and the zero-variance estimate does not move
        assert wait_until(lambda: q.qsize() == 3)
        assert f.dropped == 1 and f.zero_variance_share == 0.0
    finally:
        f.stop.set()


def test_the_feeder_releases_further_ahead_as_admission_grows():
    P = 4
    a = Admission(max_lag=2, ess_target=0.9)
    q = FakeQueue(100)
    f = Feeder(sample_stream, q.put, prompts_per_step=P, staleness=Staleness(2, a), group_size=2, poll_s=0.001)
    f.set_synced(0)
    f.start()
    try:
        assert wait_until(lambda: q.qsize() == P)
        time.sleep(0.05)
        assert q.qsize() == P  # on-policy to begin with: one step's prompts, not max_lag + 1 steps'
        a.observe(1, {0: 0.99})
        assert wait_until(lambda: q.qsize() == 2 * P)  # the feeder sees the new lag on its next poll
        a.observe(2, {1: 0.98})
        assert wait_until(lambda: q.qsize() == 3 * P)
        a.observe(3, {2: 0.97})  # max_lag is the cap
        time.sleep(0.05)
        assert q.qsize() == 3 * P
    finally:
        f.stop.set()


def test_config_validation_names_the_field():
    with pytest.raises(ConfigError, match=r"async\.admission='ada'"):
        AsyncConfig(admission="ada")
    with pytest.raises(ConfigError, match=r"async\.ess_target=0"):
        AsyncConfig(ess_target=0.0)
    with pytest.raises(ConfigError, match=r"async\.ess_floor=0\.95.*ess_target=0\.9"):
        AsyncConfig(admission="adaptive", ess_floor=0.95)
    with pytest.raises(ValueError, match=r"Admission\.ahead=3"):
        Admission(max_lag=2, ess_target=0.9, ahead=3)
