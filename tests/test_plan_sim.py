"""The pipeline model (`asyncrl/plan`) against cases whose answer is known in closed form, and the mechanisms it
claims to model each shown to act: the tail, staleness drops, zero-variance drops, overlap, the sync's park."""

from __future__ import annotations

import pytest

from asyncrl.plan.inputs import Affine, Layout, Lengths, ProgramTimes
from asyncrl.plan.sim import simulate

T = ProgramTimes(decode_step=Affine(0.01, 0.001), prefill=Affine(0.05), train_step=Affine(0.2),
                 sync_cast_s=0.03, sync_transfer_s=0.07)
FLAT = Lengths((10,), prompt=5)


def _layout(**kw) -> Layout:
    base = dict(prompts_per_step=2, group_size=4, replicas=1, decode_batch=8, max_lag=0, steps=20)
    return Layout(**{**base, **kw})


@pytest.mark.parametrize("overlap", [False, True])
def test_on_policy_step_is_the_sum_of_its_programs(overlap):
    """max_lag 0, one replica holding the whole step: each step is a prefill, 10 decode steps of 8 rows, a train
    step and the sync (cast + chain), one after the other, with or without overlap (nothing can run beside it)."""
    r = simulate(T, FLAT, _layout(overlap=overlap))
    want = 0.05 + 10 * (0.01 + 8 * 0.001) + 0.2 + 0.03 + 0.07
    assert r.step_s == pytest.approx(want, rel=1e-9)
    assert r.trainer_busy == pytest.approx(0.2 / want, rel=1e-9)
    assert r.inference_busy == pytest.approx((0.05 + 0.18) / want, rel=1e-9)
    assert r.sync_blocked_s == pytest.approx(0.03 if overlap else 0.1, rel=1e-9)
    assert r.decode_occupancy == pytest.approx(1.0)
    assert r.dropped_lag == 0 and r.lag_mean == 0.0


def test_max_lag_one_overlaps_inference_with_training():
    """With one step of lag the replica generates step s+1 while step s trains: the step time is the slower side.
    Inference: prefill + decode + the chain it parks for (0.30 s); the trainer: train + cast (0.23 s). Rows that
    finish together come out of their slots one per call, and with the next prompts already queued the replica
    prefills them first, so a group can also wait for one prefill (0.05 s): the step lies between."""
    r = simulate(T, FLAT, _layout(max_lag=1, overlap=True))
    assert 0.05 + 0.18 + 0.07 - 1e-9 <= r.step_s <= 0.05 + 0.18 + 0.07 + 0.05
    slow_trainer = ProgramTimes(T.decode_step, T.prefill, Affine(0.5), T.sync_cast_s, T.sync_transfer_s)
    r = simulate(slow_trainer, FLAT, _layout(max_lag=1, overlap=True))
    assert r.step_s == pytest.approx(0.5 + 0.03, rel=1e-6)  # trainer bound: train + cast
    assert r.trainer_busy == pytest.approx(0.5 / 0.53, rel=1e-6)
    assert 0.9 <= r.lag_mean <= 1.0


def test_the_tail_of_lengths_costs_occupancy_and_time():
    """Same mean length, one with a long tail: on policy, the step waits for its longest sample while the batch
    empties, so occupancy falls and the step takes longer."""
    flat = Lengths((40,), prompt=5)
    tail = Lengths.parametric(mean=40, max_len=400, prompt=5, tail=1.0)
    lay = _layout(prompts_per_step=8, group_size=4, decode_batch=32, steps=30)
    a, b = simulate(T, flat, lay), simulate(T, tail, lay)
    assert a.decode_occupancy == pytest.approx(1.0)
    assert b.decode_occupancy < 0.6 and b.step_s > 1.5 * a.step_s


def test_decode_batch_smaller_than_the_step_runs_in_waves():
    """16 rows through an 8-row batch: two waves of 10 decode steps."""
    r = simulate(T, FLAT, _layout(prompts_per_step=4))
    assert r.step_s == pytest.approx(0.05 + 20 * 0.018 + 0.2 + 0.1, rel=1e-9)


def test_zero_variance_groups_are_dropped_and_replaced():
    lay = _layout(prompts_per_step=4, decode_batch=64, max_lag=1, zero_variance_share=0.5,
                  filter_zero_variance=True, steps=40)
    r = simulate(T, FLAT, lay)
    assert r.steps == 40 and r.dropped_zero_variance > 0.3 * 40 * 4 * 0.5
    off = simulate(T, FLAT, Layout(**{**lay.__dict__, "filter_zero_variance": False}))
    assert off.dropped_zero_variance == 0 and off.step_s < r.step_s


def test_tail_groups_come_back_too_stale_and_are_dropped():
    """A long tail of lengths and a fast trainer: the longest groups miss their last trainable step and are dropped
    for lag. With a straggler wait the trainer waits for them instead."""
    times = ProgramTimes(Affine(0.01, 0.001), Affine(0.05), Affine(0.05), 0.0, 0.01)
    lengths = Lengths.parametric(mean=30, max_len=300, prompt=5, tail=1.2, seed=1)
    lay = _layout(prompts_per_step=8, group_size=4, replicas=2, decode_batch=16, max_lag=1, steps=40,
                  straggler_wait_s=0.0)
    r = simulate(times, lengths, lay)
    assert r.dropped_lag > 0
    waited = simulate(times, lengths, Layout(**{**lay.__dict__, "straggler_wait_s": 10.0}))
    assert waited.dropped_lag < r.dropped_lag


def test_every_step_trains_exactly_its_groups():
    lay = _layout(prompts_per_step=8, group_size=4, replicas=3, decode_batch=16, max_lag=2, steps=25,
                  zero_variance_share=0.2, filter_zero_variance=True)
    sim_lengths = Lengths.parametric(mean=20, max_len=100, prompt=5, tail=0.8)
    from asyncrl.plan.sim import Simulation

    s = Simulation(T, sim_lengths, lay)
    r = s.run()
    assert r.steps == 25
    consumed = 25 * 8 + s.dropped
    # every released position is trained, dropped, or still in flight / pooled
    assert s.next_pos == consumed + len(s.groups) + len(s.pool)


def test_bad_layout_names_the_field():
    with pytest.raises(ValueError, match="max_lag"):
        _layout(max_lag=-1)
    with pytest.raises(ValueError, match="zero_variance_share"):
        _layout(zero_variance_share=1.0)


@pytest.mark.parametrize("field", ["queue_hop_s", "decode_call_host_s", "idle_poll_s"])
def test_host_side_costs_lengthen_an_on_policy_step_in_proportion(field):
    """Queue round trips, host work per decode call and an idle replica's poll all sit on the critical path of an
    on-policy step (nothing overlaps it): each lengthens the step, more for a larger cost. Host work is paid once
    per decode call, so twice as much lengthens the step exactly twice as much; queue calls also change what the
    replica finds on the queue (prompts arrive one by one, so it prefills them in two calls), and a sync waits for
    the end of the poll cycle under way, so those two only grow."""
    import dataclasses

    base = simulate(T, FLAT, _layout()).step_s
    d1 = simulate(dataclasses.replace(T, **{field: 0.002}), FLAT, _layout()).step_s - base
    d2 = simulate(dataclasses.replace(T, **{field: 0.004}), FLAT, _layout()).step_s - base
    assert 0 < d1 < d2
    if field == "decode_call_host_s":
        assert d2 == pytest.approx(2 * d1, rel=1e-6)


def test_rows_enter_one_per_decode_call_each_call_paying_its_fixed_cost():
    """The engine substitutes one row per decode call, and a call with more rows waiting returns at once: the 8
    rows of the on-policy step take 7 calls that only insert, then the decode call of the last (which also runs the
    10 steps). A call also takes one finished row out, so the 8 rows that finish together need 7 more calls (with
    nothing queued, each through the worker's loop: its queue looks cost 0 here). Each of the 15 calls costs
    `decode_call_s` (4 ms) on top of the closed form above."""
    import dataclasses

    t = dataclasses.replace(T, decode_call_s=0.004)
    r = simulate(t, FLAT, _layout())
    want = 0.05 + 15 * 0.004 + 10 * (0.01 + 8 * 0.001) + 0.2 + 0.03 + 0.07
    assert r.step_s == pytest.approx(want, rel=1e-9)
    assert r.inference_busy == pytest.approx((0.05 + 15 * 0.004 + 0.18) / want, rel=1e-9)
