"""The shared-cores term of the pipeline model (`asyncrl/plan/cores.py`): processor sharing against cases whose
answer is known, the model reducing exactly to the one without it when the cores suffice, and the fit recovering
the solo costs a contended run was made with."""

from __future__ import annotations

import dataclasses
import heapq
import itertools

import pytest

from asyncrl.plan.cores import CoreShare, Cpu, share_rate
from asyncrl.plan.from_run import _scaled, solo_times, what_if
from asyncrl.plan.inputs import Affine, Layout, Lengths, ProgramTimes
from asyncrl.plan.sim import Simulation, simulate


class _Clock:
    """A bare event loop for a `Cpu` alone."""

    def __init__(self):
        self.now, self.q, self.seq = 0.0, [], itertools.count()

    def at(self, when, fn, *args):
        heapq.heappush(self.q, (when, next(self.seq), fn, args))

    def run(self):
        while self.q:
            self.now, _, fn, args = heapq.heappop(self.q)
            fn(*args)


def _two_jobs(cores: float, replica_solo: float) -> tuple[float, float]:
    """The trainer (1 s of solo work) and a replica call (`replica_solo` s) both start at 0, each asking for one core:
    when each ends."""
    c = _Clock()
    cpu = Cpu(CoreShare(cores, trainer=1.0, replica=1.0), c.at, lambda: c.now)
    ends = {}
    cpu.train(1.0, lambda start: ends.__setitem__("trainer", c.now))
    scale = cpu.replica_scale(starts=True)

    def replica_done():
        ends["replica"] = c.now
        cpu.replica_stops()

    c.at(cpu.replica_work(replica_solo, scale), replica_done)
    c.run()
    return ends["trainer"], ends["replica"]


def test_two_processes_on_one_core_each_take_twice_as_long():
    assert _two_jobs(1.0, 1.0) == pytest.approx((2.0, 2.0))


def test_two_processes_on_two_cores_run_at_full_speed():
    assert _two_jobs(2.0, 1.0) == (1.0, 1.0)


def test_the_trainer_speeds_up_when_the_replica_stops():
    """On one core: the replica's 0.5 s call runs at half speed (ends at 1 s); by then the trainer has done 0.5 s of
    its 1 s, and the rest alone: it ends at 1.5 s."""
    assert _two_jobs(1.0, 0.5) == pytest.approx((1.5, 1.0))


def test_share_rate():
    assert share_rate(2, [1, 1]) == 1.0
    assert share_rate(2, [2, 2]) == 0.5
    assert share_rate(2, [1.2, 1.2, 1.2]) == pytest.approx(2 / 3.6)
    assert CoreShare(0.0).rate(True, 5) == 1.0  # off: every process its own machine
    assert CoreShare(4.0).rate(True, 1) == 0.5  # demands default to the whole machine


T = ProgramTimes(decode_step=Affine(0.002, 0.0005), prefill=Affine(0.01), train_step=Affine(0.15, 2e-6),
                 sync_cast_s=0.002, sync_transfer_s=0.01, decode_call_s=0.001, decode_call_host_s=0.0003,
                 queue_hop_s=0.002, idle_poll_s=0.05)
LENS = Lengths.parametric(mean=20, max_len=64, prompt=8, tail=0.6, seed=1)


def _layout(**kw) -> Layout:
    base = dict(prompts_per_step=4, group_size=8, replicas=1, decode_batch=32, max_lag=1, steps=25)
    return Layout(**{**base, **kw})


@pytest.mark.parametrize("max_lag,replicas", [(0, 1), (1, 1), (2, 2)])
def test_enough_cores_give_exactly_the_model_without_them(max_lag, replicas):
    """Cores >= every process's demand together: the rate is always 1, nothing is re-timed, and the simulation is
    today's to the last bit (as at target scale, where the term is off)."""
    off = simulate(T, LENS, _layout(max_lag=max_lag, replicas=replicas))
    on = simulate(T, LENS, _layout(max_lag=max_lag, replicas=replicas, shared_cores=8.0, trainer_cores=2.0,
                                   replica_cores=2.0))
    assert on.row() == off.row()
    assert on.step_s_all == off.step_s_all


def test_sharing_slows_the_overlapping_layout_more():
    """At max_lag 0 the trainer and the replica take turns, at 1 they overlap: sharing 2 cores slows lag 1 more."""
    share = dict(shared_cores=2.0, trainer_cores=1.5, replica_cores=1.5)
    slow = {lag: simulate(T, LENS, _layout(max_lag=lag, **share)).step_s
            / simulate(T, LENS, _layout(max_lag=lag)).step_s for lag in (0, 1)}
    assert 1.0 <= slow[0] < slow[1]


def test_the_fit_recovers_the_solo_costs_of_a_contended_run():
    """A synthetic contended run: solo costs T, run on 2 shared cores, so each program's mean wall time (what a
    run's logs give) is its solo time x the slowdown the overlap caused. De-contending those recovers T."""
    lay = _layout(max_lag=1, shared_cores=2.0, trainer_cores=1.5, replica_cores=1.5)
    sim = Simulation(T, LENS, lay)
    sim.run()
    slow_t, slow_r = sim.cpu.train_slowdown, sim.cpu.replica_slowdown
    assert slow_t > 1.1 and slow_r > 1.02  # it was contended
    measured = _scaled(T, slow_t, slow_r)
    solo, fit_t, fit_r = solo_times(measured, LENS, lay)
    assert fit_t == pytest.approx(slow_t, rel=0.01) and fit_r == pytest.approx(slow_r, rel=0.01)
    assert solo.train_step.fixed == pytest.approx(T.train_step.fixed, rel=0.01)
    assert solo.train_step.per_unit == pytest.approx(T.train_step.per_unit, rel=0.01)
    assert solo.decode_step.per_unit == pytest.approx(T.decode_step.per_unit, rel=0.01)
    assert solo.decode_call_s == pytest.approx(T.decode_call_s, rel=0.01)
    assert solo.queue_hop_s == T.queue_hop_s  # waits on other processes: as measured


def test_off_the_fit_keeps_the_measured_costs():
    lay = _layout()
    assert solo_times(T, LENS, lay) == (T, 1.0, 1.0)


def test_what_if_takes_config_names():
    from asyncrl.plan.from_run import Measured, RunReplay

    rep = RunReplay(T, LENS, _layout(), Measured(25, 1.0, 0.5, 0.5, 1.0, 0.0))
    assert what_if(rep, max_decode_batch_size=16).decode_batch == 16
    assert what_if(rep, **{"inference.max_decode_batch_size": 64, "max_lag": 2}) == dataclasses.replace(
        rep.layout, decode_batch=64, max_lag=2)
    with pytest.raises(ValueError, match="unknown layout field"):
        what_if(rep, decode_batchh=3)


def test_processes_share_cores_only_when_hosts_json_puts_them_on_one_machine(tmp_path, monkeypatch):
    import json
    import os

    from asyncrl.plan.from_run import _shared_cores

    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert _shared_cores(str(tmp_path)) == 0  # the run does not say
    one = [{"rank": 0, "role": "trainer", "host": "vm"}, {"rank": 1, "role": "inference", "host": "vm"}]
    (tmp_path / "hosts.json").write_text(json.dumps(one))
    assert _shared_cores(str(tmp_path)) == 6
    (tmp_path / "hosts.json").write_text(json.dumps([one[0], {**one[1], "host": "tpu-1"}]))
    assert _shared_cores(str(tmp_path)) == 0


def test_a_run_on_one_machine_is_read_as_solo_costs(tmp_path, monkeypatch):
    """The synthetic run of test_plan_from_run, its processes put on one 2-core machine by hosts.json: the layout
    records the cores, and the costs fed are solo ones that, replayed with the run's own overlap, take as long as
    the run measured (the fixed point); without hosts.json, the costs as measured."""
    import json
    import os

    from asyncrl.plan.from_run import read_run
    from tests.test_plan_from_run import _synthetic_run

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    run, _ = _synthetic_run(tmp_path)
    plain = read_run(str(run), skip_steps=3)
    (run / "hosts.json").write_text(json.dumps([{"rank": 0, "role": "trainer", "host": "vm"},
                                                {"rank": 1, "role": "inference", "host": "vm"}]))
    shared = read_run(str(run), skip_steps=3)
    assert plain.layout.shared_cores == 0 and shared.layout.shared_cores == 2
    sim = Simulation(shared.times, shared.lengths, shared.layout)
    sim.run()
    assert sim.cpu.train_slowdown > 1.0  # it overlapped, so the solo step is shorter than measured
    assert shared.times.train_step.fixed * sim.cpu.train_slowdown == pytest.approx(plain.times.train_step.fixed,
                                                                                   rel=0.02)
    assert shared.times.decode_call_s * sim.cpu.replica_slowdown == pytest.approx(plain.times.decode_call_s,
                                                                                  rel=0.02)
