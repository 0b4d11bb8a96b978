"""`launch.py plan --from-run`: a run's logs -> the pipeline model's inputs and the measured figures. First on a
synthetic run directory whose true costs are known (each fit must recover them), then on a real local run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from asyncrl.config.loader import load_config, load_run_config, to_yaml
from asyncrl.plan.from_run import read_run, what_if
from asyncrl.plan.sim import simulate
from tests.helpers import TINY, launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write(path, records):
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def _synthetic_run(tmp_path, decode=(0.004, 0.0005), train=(0.05, 2e-5), steps=20, call_s=0.0015):
    cfg = load_config("default", ["async.max_lag=1"])
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(to_yaml(cfg))
    rng = np.random.default_rng(0)
    rows, t = [], 1000.0
    for s in range(1, steps + 1):
        tokens = float(rng.integers(500, 1500))
        work = train[0] + train[1] * tokens
        wait, blocked = 0.1, 0.01
        t += work + wait + blocked
        rows.append({"step": s, "step_time_s": work + wait + blocked, "rollout/queue_wait_s_max": wait,
                     "weight_sync/trainer_blocked_s": blocked, "train/tokens": tokens, "time": t,
                     "weight_sync_prepare_s": 0.004, "inference/weight_sync_sync_s": 0.05,
                     "inference/weight_sync_park_s": 0.02, "rollout/filtered_lag": float(s % 2)})
    _write(run / "metrics.jsonl", rows)
    reps, c = [], dict(decode_time_s=0.0, decode_steps=0.0, slot_steps=0.0, prefill_s=0.0, prefill_calls=0.0,
                       decode_calls=0.0)
    for i in range(40):  # a report every 0.5 s, occupancy and calls varying from window to window
        n = float(8 + (i * 7) % 25)
        steps_w, calls_w = 20.0, float(30 + (i * 11) % 40)
        c = {**c, "decode_time_s": c["decode_time_s"] + steps_w * (decode[0] + decode[1] * n) + calls_w * call_s,
             "decode_steps": c["decode_steps"] + steps_w, "slot_steps": c["slot_steps"] + steps_w * n,
             "prefill_s": c["prefill_s"] + 0.02, "prefill_calls": c["prefill_calls"] + 2,
             "decode_calls": c["decode_calls"] + calls_w}
        reps.append({"host": "inference1/r0", "t": 1000.0 + 0.5 * i, **c})
    _write(run / "inference.jsonl", reps)
    _write(run / "rollouts.jsonl", [{"step": 1, "prompt_tokens": 12,
                                     "completions": [{"n_tokens": n} for n in (3, 5, 7, 9)]}])
    return run, cfg


def test_the_fits_recover_the_costs_a_synthetic_run_was_made_with(tmp_path):
    run, cfg = _synthetic_run(tmp_path)
    rep = read_run(str(run), skip_steps=3)
    assert rep.times.decode_step.fixed == pytest.approx(0.004, rel=1e-6)
    assert rep.times.decode_step.per_unit == pytest.approx(0.0005, rel=1e-6)
    assert rep.times.decode_call_s == pytest.approx(0.0015, rel=1e-6)  # most calls only take a row in
    assert rep.times.train_step.fixed == pytest.approx(0.05, rel=1e-6)
    assert rep.times.train_step.per_unit == pytest.approx(2e-5, rel=1e-6)
    assert rep.times.prefill.fixed == pytest.approx(0.01)
    assert rep.times.sync_cast_s == pytest.approx(0.004) and rep.times.sync_transfer_s == pytest.approx(0.03)
    assert rep.lengths.completions == (3, 5, 7, 9) and rep.lengths.prompt == 12
    lay = rep.layout
    assert (lay.prompts_per_step, lay.group_size, lay.max_lag, lay.replicas) == (cfg.prompts_per_step, 8, 1, 1)
    m = rep.measured
    steady = [json.loads(line) for line in open(run / "metrics.jsonl")][3:]
    total = sum(r["step_time_s"] for r in steady)
    assert m.step_s == pytest.approx(total / len(steady))
    assert m.trainer_busy == pytest.approx(sum(r["step_time_s"] - 0.11 for r in steady) / total)  # less waits
    assert m.dropped_lag_per_step == pytest.approx(np.mean([s % 2 for s in range(4, 21)]))
    assert 0 < m.decode_occupancy < 1 and 0 < m.inference_busy <= 1
    # The model runs on what was read, and a what-if changes only what it names.
    more = what_if(rep, replicas=2, max_lag=2)
    assert (more.replicas, more.max_lag, more.decode_batch) == (2, 2, lay.decode_batch)
    assert simulate(rep.times, rep.lengths, lay).steps == lay.steps
    with pytest.raises(ValueError, match="decode_batchh"):
        what_if(rep, decode_batchh=4)


def test_a_run_config_reads_back_equal(tmp_path):
    cfg = load_config("default", ["async.max_lag=2", "inference.max_decode_batch_size=16"])
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    assert load_run_config(str(tmp_path / "config.yaml")) == cfg


def test_a_run_from_before_the_planner_is_refused_with_a_reason(tmp_path):
    run, _ = _synthetic_run(tmp_path)
    os.remove(run / "inference.jsonl")
    with pytest.raises(ValueError, match="inference.jsonl"):
        read_run(str(run))
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        read_run(str(tmp_path))


@pytest.mark.slow
def test_plan_replays_a_real_local_run(tmp_path):
    """A real two-host run logs what the planner needs; `launch.py plan --from-run` replays it and answers a
    what-if. The prediction's accuracy is measured in benchmarks/plan_validate.py, not asserted here."""
    run_dir = str(tmp_path / "run")
    res = launch(run_dir, *TINY, "train.total_steps=12", "logging.rollouts_every_n_steps=1")
    assert res.returncode == 0, res.stderr[-3000:]
    assert os.path.getsize(os.path.join(run_dir, "inference.jsonl")) > 0
    out = tmp_path / "plan.json"
    p = subprocess.run([sys.executable, "launch.py", "plan", "--from-run", run_dir, "--what-if", "max_lag=2",
                        "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["case"] for r in rows][:2] == ["measured", "as run"] and len(rows) == 3
    assert all(r["step_s"] > 0 for r in rows)


def test_a_run_config_from_before_environments_by_import_path_reads_back(tmp_path):
    """Older run folders name a source's task in `name` and its episode in `environment` (`tools` for a tool
    source); `plan --from-run` and `evaluate` still read them, as the one `environment` key plus `tools`."""
    cfg = load_config("smollm2_tools")
    old = to_yaml(cfg).replace("- environment: reasoning_gym\n", "- name: reasoning_gym\n    environment: tools\n")
    old = old.replace("    tools: true\n", "", 1)
    assert "name: reasoning_gym" in old and "tools: true" not in old
    (tmp_path / "config.yaml").write_text(old)
    assert load_run_config(str(tmp_path / "config.yaml")) == cfg


def test_a_source_written_the_old_way_is_refused_with_the_new_key():
    from asyncrl.validate import ConfigError

    with pytest.raises(ConfigError, match=r"task\.sources\[0\]\.name.*`environment:`"):
        load_config("default", ["task.sources=[{name: digits}]"])


def test_the_admission_sweep_sets_the_run_s_measured_ess_beside_each_lag(tmp_path, capsys):
    """`plan --from-run --sweep-admission`: the model's step time per max_lag, the ESS the
    run measured at each lag it trained (group-weighted over steps), none where it never trained, and the lag
    adaptive admission would settle at on those figures."""
    from asyncrl.cli.plan import main
    from asyncrl.plan.admission import adaptive_reach, measured_ess_by_lag

    run, _ = _synthetic_run(tmp_path)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for r in rows:  # lag 0 ESS 1; lag 1: 3 groups at 0.95 on even steps, 1 group at 0.85 on odd ones
        even = r["step"] % 2 == 0
        r |= {"staleness/groups_lag0": 5.0, "staleness/ess_lag0": 1.0, "staleness/groups_lag1": 3.0 if even else 1.0,
              "staleness/ess_lag1": 0.95 if even else 0.85, "staleness/groups_lag2": 0.0}
    _write(run / "metrics.jsonl", rows)
    ess = measured_ess_by_lag(str(run))
    assert set(ess) == {0, 1} and ess[0] == (1.0, 100.0)
    np.testing.assert_allclose(ess[1], ((30 * 0.95 + 10 * 0.85) / 40, 40.0))
    assert adaptive_reach(ess, 0.9, 4) == 1 and adaptive_reach(ess, 0.93, 4) == 0
    assert adaptive_reach({0: (1.0, 5.0)}, 0.9, 4) is None  # an on-policy run says nothing about lags
    out = tmp_path / "plan.json"
    assert main(["--from-run", str(run), "--sweep-admission", "--lags", "0", "1", "2", "--out", str(out)]) == 0
    sweep = json.loads(out.read_text())["admission"]
    assert [r["max_lag"] for r in sweep["rows"]] == [0, 1, 2] and sweep["adaptive_reach"] == 1
    assert [r["ess_measured"] for r in sweep["rows"]][::2] == [1.0, None]
    steps = [r["step_s"] for r in sweep["rows"]]
    # Overlap shortens the step; past lag 1 this run gains nothing (the sampled lengths and drops move it ~1%).
    assert steps[1] < 0.9 * steps[0] and abs(steps[2] - steps[1]) <= 0.05 * steps[1]
    assert "settle at max_lag 1" in capsys.readouterr().out
