"""End to end through `python launch.py`: 3 simulated hosts of 2 fake devices each (1 trainer with a 2-device
FSDP mesh, 2 inference workers with 2 replicas each), max_lag=1, weight sync every step."""

import json
import os
import subprocess
import time

import pytest

from tests.helpers import TINY, launch, ray_pids, rows


def test_end_to_end_three_hosts(tmp_path):
    before = ray_pids()
    run_dir = str(tmp_path / "run")
    res = launch(run_dir, *TINY, "run.hosts=3", "run.devices_per_host=2", "inference.tp=1", "async.train_workers=1",
                 "async.max_lag=1", "eval.every_n_steps=3", "checkpoint.every_n_steps=0", "checkpoint.resume=false",
                 "logging.rollouts_every_n_steps=1",
                 # Long random-init completions make decode the bottleneck, so rows are still being generated
                 # when syncs land. Each time decode got faster (per-layer CPU decode; no 50 ms poll per decode
                 # call; prompts released the moment a sync lands) runs came out with no update in flight, so
                 # both inference hosts also sleep 20 ms per decode chunk: a slow decode, whatever the machine.
                 "inference.max_seq_len=160", env_extra={"ASYNCRL_FAULTS": "slow@decode:1:20;slow@decode:2:20"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    r = rows(run_dir)
    assert [x["step"] for x in r] == [1, 2, 3, 4, 5, 6]
    for key in ("train/loss", "rollout/reward_mean", "train/tokens_per_s", "rollout/lag_min", "rollout/lag_mean",
                "rollout/lag_max", "rollout/filtered_lag", "weight_sync_s", "rollout/queue_wait_s_max"):
        assert all(key in x for x in r), key
    assert all(x["rollout/lag_max"] <= 1 for x in r)  # no trained sample exceeded max_lag
    assert [x["weight_version"] for x in r] == [1, 2, 3, 4, 5, 6]  # weights synced every step
    versions = [x["inference/version"] for x in r if "inference/version" in x]
    assert versions and max(versions) > min(versions)  # the inference side saw the version rise
    assert any("inference/decode_tokens_per_s" in x for x in r)
    # Both inference hosts served with both of their replicas.
    with open(os.path.join(run_dir, "rollouts.jsonl")) as f:
        lines = [json.loads(x) for x in f]
    logged = [g for g in lines if "completions" in g]  # trained groups; the rest are the step's dropped groups
    drops = [g for g in lines if "dropped" in g]
    assert len(drops) == sum(x["rollout/filtered_lag"] + x["rollout/filtered_zero_variance"] for x in r)
    assert all(d["dropped"] == "lag" and d["step"] - 1 - d["oldest_version"] > 1 for d in drops)
    assert sorted({g["step"] for g in logged}) == [1, 2, 3, 4, 5, 6]
    # Every replica served: trained, dropped (too stale) or eval groups. Which replica gets which prompts is timing:
    # on 2 shared cores a host up a few seconds late may find the short run's train prompts taken, and take the
    # next eval round's (served first) instead; all three logs name the replica.
    with open(os.path.join(run_dir, "eval_samples.jsonl")) as f:
        eval_groups = [json.loads(x) for x in f]
    served = {}
    for g in logged + drops + eval_groups:
        served[g["worker"]] = served.get(g["worker"], 0) + 1
    assert len(served) == 4, served
    # In-flight updates: a sync landed while rows were being generated, so some trained completions carry two
    # weight versions, the later one no newer than the trainer's, and generation went on past the boundary.
    updated = [(g, c) for g in logged for c in g["completions"] if len(c["versions"]) > 1]
    assert updated and sum(x["rollout/in_flight_updated"] for x in r) == len(updated)
    for g, c in updated:
        starts, versions = zip(*c["versions"])
        assert 0 == starts[0] < starts[1] < c["n_tokens"] and list(versions) == sorted(set(versions))
        assert versions[-1] <= g["trainer_version"] and g["trainer_version"] - versions[0] <= 1
    evals = [x for x in r if "eval/reward_mean" in x]
    assert evals and all("eval/pass@1" in x and "eval/pass@2" in x for x in evals)
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(os.path.join(run_dir, "tb")))
    assert os.path.isfile(os.path.join(run_dir, "reward_curve.png"))
    assert "eval reward before RL" in res.stdout
    # The driver started its own cluster and took it down: nothing new is left running.
    deadline = time.time() + 20
    while (ray_pids() - before) and time.time() < deadline:
        time.sleep(1)
    assert not (ray_pids() - before), subprocess.run(["ps", "-fp", ",".join(map(str, ray_pids() - before))],
                                                      capture_output=True, text=True).stdout


@pytest.mark.slow
def test_two_trainer_hosts_with_the_sync_behind_the_step(tmp_path):
    """4 hosts, train_workers=2: the trainer slot spans two processes, whose train steps run gloo collectives while
    the previous weights travel on each one's background sync thread (weightsync.overlap). Evals must see the
    weights of their step, and a checkpoint lands mid-run. The format warm-start runs cold (an empty cache), so
    both trainer hosts gather their sharded params for it (CI: a plain device_get of them failed)."""
    run_dir = str(tmp_path / "run")
    res = launch(run_dir, *TINY, "run.hosts=4", "async.train_workers=2", "train.total_steps=8", "eval.every_n_steps=3",
                 "checkpoint.every_n_steps=4", "train.format_warmstart_steps=20",
                 env_extra={"ASYNCRL_CACHE": str(tmp_path / "cache")})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    r = rows(run_dir)
    assert [x["step"] for x in r] == list(range(1, 9)) and [x["weight_version"] for x in r] == list(range(1, 9))
    assert all(x["weight_sync/trainer_blocked_s"] >= 0 and x["weight_sync_s"] > 0 for x in r)
    with open(os.path.join(run_dir, "evals.jsonl")) as f:
        assert [json.loads(x)["round"] for x in f] == [0, 3, 6, 8]  # every round, each after its step's sync
    assert sorted(int(d) for d in os.listdir(os.path.join(run_dir, "checkpoints")) if d.isdigit())[-1] == 8
    assert [d for d in os.listdir(tmp_path / "cache") if d.startswith("warmstart-")], "the warm-start was not cached"


def test_bad_override_fails_fast(tmp_path):
    t0 = time.time()
    res = launch(str(tmp_path / "r"), "async.train_workers=2", "run.hosts=3")
    assert res.returncode == 2 and "async.train_workers=2" in res.stderr
    assert time.time() - t0 < 60
