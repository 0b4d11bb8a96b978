"""The adaptive straggler wait (`orchestration/staleness.py`: `StragglerWait`), alone and in the simulated loop."""

import pytest

from asyncrl.orchestration.staleness import StragglerWait
from tests.helpers import Sim


def test_the_straggler_wait_doubles_after_a_miss_and_shrinks_toward_what_it_needed():
    w = StragglerWait(floor_s=0.5, cap_s=4.0)
    w.note_busy(10.0)  # long steps: waiting up to the cap is within the trainer's busy time
    w.observe([], gave_up=True)
    assert w.current_s == 1.0
    for _ in range(5):
        w.observe([], gave_up=True)
    assert w.current_s == 4.0  # capped
    w.observe([1.5], gave_up=False)  # the stragglers came, the slowest 1.5 s after the step was full
    assert w.current_s == pytest.approx(3.6)  # 10% shorter, still above twice 1.5 s
    for _ in range(50):
        w.observe([0.05], gave_up=False)
    assert w.current_s == 0.5  # back to the floor once they come quickly
    # Short steps: the trainer never idles for stragglers longer than it works (a slow host's groups are dropped).
    short = StragglerWait(floor_s=0.5, cap_s=8.0)
    short.note_busy(0.3)
    for _ in range(5):
        short.observe([], gave_up=True)
    assert short.current_s == 0.5
    for _ in range(10):
        short.note_busy(1.2)
    short.observe([], gave_up=True)
    assert 0.5 < short.current_s <= 1.2
    fixed = StragglerWait(0.5, 4.0, adaptive=False)
    fixed.observe([], gave_up=True)
    assert fixed.current_s == 0.5


@pytest.mark.parametrize("adaptive", [False, True])
def test_slow_stragglers_are_dropped_by_a_fixed_wait_and_caught_by_an_adaptive_one(adaptive):
    """Steps that work 0.6 s, and one group a step that takes 1.2 s to generate: a fixed 0.2 s wait drops nearly
    all of them for lag (11 of 10 steps' worth here, replacements included); the adaptive one grows, within the 0.6 s
    the trainer works, and catches them (2 drops here)."""
    sim = Sim(P=4, max_lag=1, rewards=lambda p: [p % 2, 1 - p % 2], replicas=4, step_s=0.6,
              decode_s=lambda p: 1.2 if p % 4 == 3 else 0.01)
    wait = StragglerWait(0.2, 4.0, adaptive=adaptive)
    wait.note_busy(0.6)
    metrics = sim.run(10, straggler=wait)
    drops = sum(m["rollout/filtered_lag"] for m in metrics)
    if adaptive:
        assert drops <= 4, drops
        assert 0.2 < wait.current_s <= 0.6
    else:
        assert drops >= 6, drops
    assert max(m["rollout/lag_max"] for m in metrics) <= 1

