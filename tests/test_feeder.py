"""The prompt feeder (`orchestration/feeder.py`): its gate (max_lag steps ahead), drop credit, oversampling for
DAPO, errors that surface instead of timeouts, and the state a checkpoint keeps (resume positions, the zero-variance
share); and the simulated loop (feeder -> fake inference -> collector) for oversampled steps and a resume."""

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from asyncrl.orchestration.collect import RolloutTimeout, collect_rollouts
from asyncrl.orchestration.feeder import Feeder, FeederError
from asyncrl.orchestration.messages import GroupConsumed
from asyncrl.orchestration.staleness import Staleness
from tests.helpers import FakeQueue, Sim, sample_stream, wait_until


def make_feeder(P=4, max_lag=1, maxsize=1000, **kw):
    q = FakeQueue(maxsize)
    f = Feeder(sample_stream, q.put, prompts_per_step=P, staleness=Staleness(max_lag), group_size=2, poll_s=0.001,
               **kw)
    return f, q


def released(q):
    return [item.position for item in q.drain()]


@pytest.mark.parametrize("max_lag", [0, 1, 2])
def test_feeder_releases_exactly_max_lag_steps_ahead(max_lag):
    P = 4
    f, q = make_feeder(P, max_lag)
    f.set_synced(0)  # the initial sync: inference holds version 0
    f.start()
    # Step s trains on version s-1 and accepts version >= s-1-max_lag: with v=0 synced, steps 1..max_lag+1.
    assert wait_until(lambda: q.qsize() == P * (max_lag + 1))
    time.sleep(0.05)
    assert released(q) == list(range(P * (max_lag + 1)))  # and not one more (no step of slack)
    f.set_synced(1)
    assert wait_until(lambda: q.qsize() == P)
    time.sleep(0.05)
    assert released(q) == list(range(P * (max_lag + 1), P * (max_lag + 2)))
    f.stop.set()


def test_a_drop_releases_a_replacement_at_once():
    f, q = make_feeder(P=4, max_lag=0)
    f.set_synced(0)
    f.start()
    assert wait_until(lambda: q.qsize() == 4)
    time.sleep(0.02)
    assert released(q) == [0, 1, 2, 3]
    f.consumed(1, "zero_variance")  # before the step: the trainer is short one group
    assert wait_until(lambda: q.qsize() == 1)
    assert released(q) == [4]
    f.consumed(0, None)  # a kept group frees nothing until the weights move on
    time.sleep(0.05)
    assert q.qsize() == 0
    # The share: 0.05 toward 1 (a zero-variance drop), then 0.05 toward 0 (a kept group).
    assert f.state() == {"position": 5, "dropped": 1, "in_flight": [2, 3, 4], "zero_variance_share": 0.0475}
    with pytest.raises(ValueError, match="position 0 was never released or was already consumed"):
        f.consumed(0, None)
    f.stop.set()


def test_remote_ranks_credit_through_the_drain():
    reports = []  # what trainer ranks > 0 put on the 'consumed' queue
    f, q = make_feeder(P=2, max_lag=0, drain_remote=lambda: [reports.pop(0) for _ in range(len(reports))])
    f.set_synced(0)
    f.start()
    assert wait_until(lambda: q.qsize() == 2)
    reports.append(GroupConsumed(1, "lag", 1))  # rank 1 dropped the group of position 1
    assert wait_until(lambda: q.qsize() == 3)  # the feeder drains while it waits, and replaces it
    assert released(q) == [0, 1, 2]
    assert f.state() == {"position": 3, "dropped": 1, "in_flight": [0, 2], "zero_variance_share": 0.0}
    f.stop.set()


def test_feeder_error_surfaces_with_its_traceback_instead_of_a_timeout():
    def broken():
        yield SimpleNamespace(id="ok")
        raise KeyError("dataset row 1 has no 'question' field")

    q = FakeQueue()
    f = Feeder(broken, q.put, prompts_per_step=4, staleness=Staleness(0), group_size=1, poll_s=0.001)
    f.set_synced(0)
    f.start()
    rq = FakeQueue()
    t0 = time.time()
    with pytest.raises(FeederError, match=r"(?s)no 'question' field.*Traceback.*in broken"):
        collect_rollouts(rq.poll, 4, 0, Staleness(0), timeout_s=60, check=f.check, poll_s=0.05)
    assert time.time() - t0 < 10  # not the 60 s rollout timeout
    with pytest.raises(RolloutTimeout):  # without a feeder error the timeout is still there
        collect_rollouts(rq.poll, 1, 0, Staleness(0), timeout_s=0.1, poll_s=0.02)


def test_feeder_put_gives_up_with_a_message():
    q = FakeQueue(maxsize=1)
    f = Feeder(sample_stream, q.put, prompts_per_step=4, staleness=Staleness(0), group_size=1, poll_s=0.001,
               timeout_s=1.5)
    f.set_synced(0)
    f.start()
    assert wait_until(lambda: f.error is not None, timeout=10)
    with pytest.raises(FeederError, match="waited 2s to put the prompt at data position 1 on the full 'prompt' queue"):
        f.check()


def test_oversampling_front_loads_the_expected_replacements():
    f, q = make_feeder(P=4, max_lag=0, oversample=True)
    f.set_synced(0)
    f.start()
    assert wait_until(lambda: q.qsize() == 4)  # no estimate yet: P
    for p in range(3):
        f.consumed(p, "zero_variance")  # the share estimate rises ...
    f.consumed(3, None)
    assert wait_until(lambda: f.state()["position"] >= 7)
    for p in range(4, 7):
        f.consumed(p, "zero_variance")
    share = f.zero_variance_share
    assert 0.2 < share < 0.4
    expected = 4 + 6 + int(np.ceil(4 * share / (1 - share)))  # P + credited drops + oversampling
    assert wait_until(lambda: f.state()["position"] == expected)
    time.sleep(0.05)
    assert f.state()["position"] == expected
    for p in range(7, 10):
        f.consumed(p, "lag")  # lag drops are credited but do not move the estimate
    assert f.zero_variance_share == share
    f.stop.set()


@pytest.mark.parametrize("max_lag", [0, 1])
def test_oversampled_dapo_steps_train_only_groups_with_variance(max_lag):
    sim = Sim(P=4, max_lag=max_lag, rewards=lambda p: [1, 1] if p % 4 else [1, 0], drop_zero_variance=True,
              oversample=True, decode_s=0.002)
    metrics = sim.run(6)
    assert all(p % 4 == 0 for _, p in sim.taken) and len(sim.taken) == 24
    assert sim.feeder.zero_variance_share > 0.5
    assert max(m["rollout/lag_max"] for m in metrics) <= max_lag


def test_resume_regenerates_in_flight_prompts_and_skips_nothing():
    rewards = lambda p: [p % 2, 1 - p % 2] if p % 5 else [0, 0]  # noqa: E731  (every 5th group dropped)
    first = Sim(P=4, max_lag=2, rewards=rewards, drop_zero_variance=True, decode_s=0.001)
    first.run(6)
    state = first.feeder.state()
    assert state["in_flight"], "max_lag=2 keeps prompts in flight at the checkpoint"
    consumed = {p for _, p in first.taken} | {p for _, p, _ in first.dropped}
    assert set(range(state["position"])) == consumed | set(state["in_flight"])  # every released position accounted
    second = Sim(P=4, max_lag=2, rewards=rewards, drop_zero_variance=True, state=state, version=first.version)
    second.run(6)
    # The in-flight prompts come first, each with its own sample (and so its own per-position seeds).
    assert second.order[:len(state["in_flight"])] == state["in_flight"]
    assert not first.wrong_sample and not second.wrong_sample
    trained = [p for _, p in first.taken] + [p for _, p in second.taken]
    dropped = [p for _, p, _ in first.dropped] + [p for _, p, _ in second.dropped]
    assert len(trained) == len(set(trained)) == 48  # nothing trained twice
    assert not set(trained) & set(dropped)
    top = max(trained)
    assert set(range(top + 1)) <= set(trained) | set(dropped) | second.feeder.in_flight  # nothing skipped
    assert all(p % 5 == 0 for p in dropped)


def test_restore_rejects_inconsistent_meta():
    f, _ = make_feeder()
    with pytest.raises(ValueError, match="in-flight positions .* must be below position 3"):
        f.restore({"position": 3, "dropped": 0, "in_flight": [1, 5]})
    f.restore({"position": 7, "dropped": 2})  # a checkpoint from before in-flight tracking
    assert f.state() == {"position": 7, "dropped": 2, "in_flight": [], "zero_variance_share": 0.0}


def test_the_zero_variance_share_survives_a_checkpoint():
    """DAPO's oversampling estimate is part of the feeder's checkpointed state: a resumed run oversamples at once,
    instead of restarting cold from P prompts a step."""
    f, _ = make_feeder(P=4, max_lag=0, oversample=True)
    f.set_synced(0)
    f.start()
    assert wait_until(lambda: f.state()["position"] == 4)
    for p in range(3):
        f.consumed(p, "zero_variance")
    f.stop.set()
    share = f.zero_variance_share
    assert share > 0
    g, _ = make_feeder(P=4, max_lag=0, oversample=True)
    g.restore(f.state())
    assert g.zero_variance_share == share
    g.set_synced(0)
    assert g.allowed() == 4 + 3 + g.oversample_for(4) and g.oversample_for(4) >= 1


def test_a_checkpoint_snapshot_sees_a_report_another_thread_is_applying():
    """Rank 0's feeder thread and trainer thread both drain the other trainer ranks' reports. If the feeder thread
    has popped a report (position 1, trained by rank 1) but not applied it yet, the trainer's drain-then-snapshot for
    a checkpoint must still see it applied: listing position 1 in flight would make a resume train it twice."""
    reports = []
    f, q = make_feeder(P=2, max_lag=0, drain_remote=lambda: [reports.pop(0) for _ in range(len(reports))])
    f.set_synced(0)
    f.start()
    assert wait_until(lambda: q.qsize() == 2)
    f.stop.set()
    f._thread.join(5)
    applying, release = threading.Event(), threading.Event()
    consumed = f.consumed

    def slow_consumed(position, reason):  # the feeder thread, between popping a report and applying it
        applying.set()
        assert release.wait(5)
        consumed(position, reason)

    f.consumed = slow_consumed
    reports.append(GroupConsumed(1, None, 1))
    drainer = threading.Thread(target=f.drain_remote)
    drainer.start()
    assert applying.wait(5) and not reports  # popped, not yet applied
    threading.Timer(0.3, release.set).start()
    f.consumed = consumed  # the trainer thread's own drain applies nothing slowly
    f.drain_remote()  # rank 0 drains before it snapshots (`TrainerWorker._feeder_state`)
    snapshot = f.state()
    drainer.join(5)
    assert snapshot["in_flight"] == [0], snapshot

