"""Chaos test (slow), in the spirit of Jepsen's nemesis: a run of 60 steps at max_lag=2, a checkpoint every 5 steps,
up to 4 restarts, and three SIGKILLs: one injected *inside* a weight sync (`ASYNCRL_FAULTS`, see
asyncrl/orchestration/faults.py) on a random host, and two sent from here at random steps, one to a trainer host and
one to a random inference host, in random order. Two variants: 3 hosts (1 trainer, 2 inference), and 4 hosts with two
trainer hosts and the KL term on (from the format warm-start), whose reference must survive every restart. The seed
is printed on failure; `CHAOS_SEED=n` replays a schedule.

What must hold afterwards:
- the run completes, after exactly three restarts;
- metrics.jsonl has every step exactly once, in order;
- no host process of any attempt outlives the driver;
- the data stream: the rollout logs of every trainer rank (cut back to the checkpoint at each resume) have every
  step once; no data position is trained twice, none is both trained and dropped, and every position the final
  checkpoint says was released is trained, dropped, or listed in flight: nothing skipped, nothing repeated;
- with the KL term, train/kl goes on across every resume without a jump.

Why the final params are not compared with a cleanly resumed run: at max_lag > 0 which weight version samples
each token depends on thread timing (when a sync lands relative to each decode chunk, which replica finishes
first), so two fault-free runs of this config already differ; bit-equality after a resume is tested at
max_lag=0 in test_orchestration_resilience.py. Here the exported params are checked to be there and finite.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.helpers import ROOT, TINY, check_data_positions, kl_jumps, launch_env, one_trainer, rows

pytestmark = pytest.mark.slow

STEPS, P = 60, 8  # TINY: train_batch_size 32 / group_size 4


def _alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def _hosts(run_dir):
    try:
        with open(os.path.join(run_dir, "hosts.json")) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _max_step(run_dir):
    try:
        return max((r["step"] for r in rows(run_dir)), default=0)
    except (FileNotFoundError, json.JSONDecodeError):
        return 0


VARIANTS = {
    "one_trainer": ["run.hosts=3", "async.train_workers=1"],
    "two_trainers_kl": ["run.hosts=4", "async.train_workers=2", "loss.kl_coef=0.05",
                        "train.format_warmstart_steps=150"],
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_chaos_three_kills_one_during_a_weight_sync(tmp_path, variant):
    seed = int(os.environ.get("CHAOS_SEED", time.time_ns() % 2**31))
    n_hosts = 4 if variant == "two_trainers_kl" else 3
    rng = np.random.default_rng(seed)
    run_dir = str(tmp_path / "run")
    sync_step = int(rng.integers(8, 20))
    sync_rank = int(rng.integers(0, n_hosts))
    # The last kill leaves 15 steps: with only 5, a fast machine could finish the run before Ray reports the death
    # of an inference host (seen once in the single-kill test that was folded in here).
    external = sorted(int(x) for x in rng.choice(np.arange(24, 46), size=2, replace=False))
    # One external kill to a trainer host and one to an inference host, in random order, so that every run sees
    # both roles die: the last trainer rank (with two trainers, the one that is not the jax.distributed coordinator;
    # the coordinator's death is test_trainer_host_killed_...'s, and the in-sync kill's when its rank draws 0) and a
    # random inference rank. The single-kill tests of an inference host restarted and of trainer rank 1 at
    # max_lag 2 were folded in here (CI time), their assertions with them.
    tw = 2 if variant == "two_trainers_kl" else 1
    external_ranks = [tw - 1, int(rng.integers(tw, n_hosts))]
    rng.shuffle(external_ranks)
    schedule = (f"{variant}, seed {seed}: kill in weight sync {sync_step} on rank {sync_rank}; "
                f"SIGKILL at steps {external} to ranks {external_ranks}")
    env = launch_env(compile_cache=one_trainer(VARIANTS[variant]))  # two trainers: no cache (helpers.launch_env)
    env["ASYNCRL_FAULTS"] = f"kill@weight_sync:{sync_rank}:{sync_step}"
    args = [*TINY, f"train.total_steps={STEPS}", *VARIANTS[variant], "async.max_lag=2",
            "checkpoint.every_n_steps=5", "run.max_restarts=4", "eval.every_n_steps=0", "checkpoint.export_hf=true",
            "logging.rollouts_every_n_steps=1", "async.queue_timeout_s=90", "run.stall_timeout_s=300",
            "inference.max_seq_len=32"]
    proc = subprocess.Popen([sys.executable, "launch.py", f"run.run_dir={run_dir}", "logging.ray_metrics=false",
                             *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        for step, rank in zip(external, external_ranks):
            deadline = time.time() + 900
            while True:  # the step reached, and the hosts of the attempt now running all up
                assert proc.poll() is None, f"{schedule}\nrun ended early:\n" + proc.stderr.read()[-4000:]
                assert time.time() < deadline, f"{schedule}: step {step} not reached"
                hosts = _hosts(run_dir)
                if _max_step(run_dir) >= step and hosts and all(_alive(h["pid"]) for h in hosts):
                    break
                time.sleep(0.2)
            os.kill(hosts[rank]["pid"], signal.SIGKILL)
            while hosts == _hosts(run_dir) and proc.poll() is None:  # wait for the restart before the next kill
                time.sleep(0.2)
        out, err = proc.communicate(timeout=1200)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, f"{schedule}\n{err[-6000:]}"
    assert err.count("restarting all hosts") == 3, f"{schedule}\n{err[-6000:]}"
    for rank in external_ranks:  # each death named with its host's role
        assert f"host {rank} ({'trainer' if rank < tw else 'inference'})" in err, f"{schedule}\n{err[-6000:]}"
    assert os.path.exists(os.path.join(run_dir, f".fault-kill-weight_sync-{sync_rank}-{sync_step}"))

    # Every step exactly once, in order.
    assert [r["step"] for r in rows(run_dir)] == list(range(1, STEPS + 1)), schedule

    # No host process of any attempt outlives the driver.
    with open(os.path.join(run_dir, "hosts_history.jsonl")) as f:
        attempts = [json.loads(x)["hosts"] for x in f]
    assert len(attempts) == 4, schedule
    pids = [h["pid"] for a in attempts for h in a]
    deadline = time.time() + 30
    while any(map(_alive, pids)) and time.time() < deadline:
        time.sleep(0.5)
    assert not [p for p in pids if _alive(p)], schedule

    # The data stream: nothing trained twice, nothing skipped.
    check_data_positions(run_dir, STEPS, P)

    # The KL reference survived every restart.
    if "loss.kl_coef=0.05" in args:
        resumed = [int(x) for x in re.findall(r"\[asyncrl\] resuming .* from checkpoint step (\d+)", err)]
        assert len(resumed) == 3 and not kl_jumps(rows(run_dir), resumed), (schedule, kl_jumps(rows(run_dir), resumed))

    # The final policy was exported, and is finite.
    from asyncrl.models.safetensors_io import SafetensorsFile

    f = SafetensorsFile(os.path.join(run_dir, "hf", "model.safetensors"))
    assert f.keys() and all(np.isfinite(np.asarray(f.get(k))).all() for k in f.keys())
