"""Checkpoint/resume, host failure, and Ray Job submission: each runs real local Ray clusters (slow)."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.helpers import ROOT, TINY, end_session, kl_jumps, launch, launch_env, rows

pytestmark = pytest.mark.slow
# With the KL term: the resume must also restore its reference (the warm-started policy), which
# test_resume_equals_uninterrupted checks on the stopped path (the killed path: test_trainer_host_killed_...).
RESUME = [*TINY, "train.format_warmstart_steps=150", "train.total_steps=8", "async.max_lag=0", "loss.kl_coef=0.05",
          "checkpoint.every_n_steps=2", "checkpoint.export_hf=true", "eval.every_n_steps=0", "run.seed=3"]


def _wait_for_step(run_dir, step, proc, timeout=400):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError("run ended early:\n" + proc.stderr.read()[-4000:])
        try:
            if any(r["step"] >= step for r in rows(run_dir)):
                return
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"step {step} not reached in {timeout}s")


def _params(run_dir):
    from asyncrl.models.safetensors_io import SafetensorsFile

    f = SafetensorsFile(os.path.join(run_dir, "hf", "model.safetensors"))
    return {k: np.array(f.get(k)) for k in f.keys()}


def test_resume_equals_uninterrupted(tmp_path):
    straight = str(tmp_path / "straight")
    res = launch(straight, *RESUME)
    assert res.returncode == 0, res.stderr[-4000:]

    resumed = str(tmp_path / "resumed")
    env = launch_env()
    # The inference host sleeps 100 ms per decode chunk, so the SIGINT lands mid-run however fast the steps are
    # (at max_lag 0 the values do not depend on timing).
    env["ASYNCRL_FAULTS"] = "slow@decode:1:100"
    proc = subprocess.Popen([sys.executable, "launch.py", f"run.run_dir={resumed}", "logging.ray_metrics=false",
                             *RESUME],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    _wait_for_step(resumed, 4, proc)
    proc.send_signal(signal.SIGINT)  # the driver's job is killed; it must take its cluster down with it
    proc.communicate(timeout=120)
    assert max(int(x) for x in os.listdir(os.path.join(resumed, "checkpoints")) if x.isdigit()) >= 4
    res = launch(resumed, *RESUME)  # same command, same run dir: resumes from the latest checkpoint
    assert res.returncode == 0, res.stderr[-4000:]
    at = _resumed_at(res.stderr)
    assert len(at) == 1 and at[0] >= 4, res.stderr[-3000:]
    assert [r["step"] for r in rows(resumed)] == list(range(1, 9))  # every step exactly once
    # train/kl goes on across the resume without a jump (before, the resumed reference was the random init), and
    # at max_lag 0 it is the uninterrupted run's, step for step.
    _kl_goes_on(resumed, at, 8)
    assert [r["train/kl"] for r in rows(resumed)] == [r["train/kl"] for r in rows(straight)]
    # Non-vacuous: the policy really moved (rewards vary, so GRPO gradients are non-zero).
    assert any(r["rollout/reward_mean"] > 0 for r in rows(straight))
    assert any(r["train/grad_norm"] > 0 for r in rows(straight))
    a, b = _params(straight), _params(resumed)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_inference_host_killed_without_restarts_fails_naming_it(tmp_path):
    """run.max_restarts=0: an inference host's death ends the run, named. (Killed and restarted: test_chaos.py,
    whose every run kills an inference host.)"""
    run_dir = str(tmp_path / "run")
    env = launch_env()
    # 30 steps, the kill at step 3: the death must be seen mid-run (at 8 steps a loaded CI machine finished the run
    # on the surviving inference host before Ray reported the death).
    args = [*TINY, "train.total_steps=30", "checkpoint.every_n_steps=2", "run.max_restarts=0",
            "eval.every_n_steps=0", "async.queue_timeout_s=60"]
    proc = subprocess.Popen([sys.executable, "launch.py", f"run.run_dir={run_dir}", "logging.ray_metrics=false", *args],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    _wait_for_step(run_dir, 3, proc)
    hosts = json.load(open(os.path.join(run_dir, "hosts.json")))
    victim = next(h for h in hosts if h["role"] == "inference")
    t0 = time.time()
    os.kill(victim["pid"], signal.SIGKILL)
    out, err = proc.communicate(timeout=400)
    assert time.time() - t0 < 400
    assert proc.returncode == 1
    assert f"host {victim['rank']} (inference) failed" in err


def test_submit_to_running_cluster(tmp_path):
    ray = shutil.which("ray", path=os.path.dirname(sys.executable))
    port, dash = 6391, 8279
    env = launch_env()
    # The cluster is this test's alone: `ray start` runs in a session of its own, which every process of the
    # cluster keeps (the head's daemons, the job's driver and hosts), and the teardown ends that session. (`ray stop
    # --force` would end every Ray process on the machine: another test's run, under pytest-xdist.) Its dashboard
    # agent, which takes the job, listens on a free port: while another cluster's agent held Ray's default (52365),
    # this one failed to bind and the submit gave up ("No available agent to submit job").
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        agent_port = s.getsockname()[1]
    head = subprocess.Popen([ray, "start", "--head", f"--port={port}", f"--dashboard-port={dash}", "--num-cpus=2",
                             "--dashboard-host=127.0.0.1", f"--dashboard-agent-listen-port={agent_port}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        out, _ = head.communicate(timeout=120)
        assert head.returncode == 0, out[-3000:]
        address = f"http://127.0.0.1:{dash}"
        run_dir = str(tmp_path / "job")
        res = subprocess.run([sys.executable, "launch.py", "submit", "--address", address, "--wait",
                              f"run.run_dir={run_dir}", "logging.ray_metrics=false", *TINY, "train.total_steps=2",
                              "eval.every_n_steps=0"], cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        job_id = res.stdout.split("submitted job ", 1)[1].split()[0]
        assert "dashboard:" in res.stdout
        st = subprocess.run([sys.executable, "launch.py", "status", job_id, "--address", address], cwd=ROOT,
                            capture_output=True, text=True, env=env, timeout=120)
        assert "SUCCEEDED" in st.stdout, st.stdout + st.stderr
        logs = subprocess.run([sys.executable, "launch.py", "logs", job_id, "--address", address], cwd=ROOT,
                              capture_output=True, text=True, env=env, timeout=120)
        assert "run summary" in logs.stdout
        assert [r["step"] for r in rows(run_dir)] == [1, 2]
    finally:
        end_session(head.pid)
        # What `ray stop` also does: forget the cluster, so that a later `ray.init()` does not try to join it.
        address_file = os.path.join("/tmp", "ray", "ray_current_cluster")
        if os.path.isfile(address_file) and open(address_file).read().strip().endswith(f":{port}"):
            os.remove(address_file)


KL = [*TINY, "train.format_warmstart_steps=150", "loss.kl_coef=0.05", "eval.every_n_steps=0", "run.seed=5",
      "logging.rollouts_every_n_steps=1", "async.queue_timeout_s=60"]


def _resumed_at(stderr):
    return [int(x) for x in re.findall(r"\[asyncrl\] resuming .* from checkpoint step (\d+)", stderr)]


def _kl_goes_on(run_dir, resumed, steps):
    """train/kl continues across the resumes without a jump at the first resumed step. Before, the resumed
    reference was the random init: train/kl went from 0.26-0.38 to 4.52 in a run."""
    r = rows(run_dir)
    assert [x["step"] for x in r] == list(range(1, steps + 1))  # every step exactly once
    kl = [x["train/kl"] for x in r]
    assert all(np.isfinite(kl)) and max(kl) > 0
    assert not kl_jumps(r, resumed), (kl_jumps(r, resumed), kl)


def test_trainer_host_killed_at_max_lag_2_resumes_with_its_in_flight_prompts_and_its_kl_reference(tmp_path):
    """The stall this guards against: at max_lag > 0 a resumed trainer used to skip the prompts that were in
    flight at its checkpoint and wait forever for groups nobody would generate. With the KL term and the format
    warm-start on, the same run checks that a killed trainer's reference survives the restart (the stopped path:
    `test_resume_equals_uninterrupted`); one run for both saves CI a run of its own."""
    run_dir = str(tmp_path / "run")
    # The trainer SIGKILLs itself as it starts step 13 (faults.py), so the checkpoint it resumes from is always
    # step 10. (A kill sent from the test after step 12 was seen raced the trainer on a fast CI machine: it had
    # already saved step 15.) Checkpoints are saved synchronously, so step 10's is complete when 13 starts.
    res = launch(run_dir, *KL, "train.total_steps=16", "async.max_lag=2", "checkpoint.every_n_steps=5",
                 "run.max_restarts=1", env_extra={"ASYNCRL_FAULTS": "kill@step:0:13"}, timeout=600)
    err = res.stderr
    assert res.returncode == 0, err[-4000:]
    assert "fault injection: kill at step (rank 0, step 13)" in err
    assert "host 0 (trainer)" in err and "restarting" in err
    assert _resumed_at(err) == [10], err[-3000:]
    _kl_goes_on(run_dir, [10], 16)


def test_stall_dumps_every_host_stack_and_fails(tmp_path):
    """A trainer that hangs (injected at step 3) publishes no step: after run.stall_timeout_s the driver dumps
    every host's thread stacks and fails the run instead of waiting forever."""
    run_dir = str(tmp_path / "run")
    res = launch(run_dir, *TINY, "train.total_steps=6", "eval.every_n_steps=0", "run.stall_timeout_s=60",
                 "run.max_restarts=2", env_extra={"ASYNCRL_FAULTS": "hang@step:0:3"})
    assert res.returncode == 1
    assert "no step published for 60s (run.stall_timeout_s)" in res.stderr
    assert "restarting" not in res.stderr  # a stall is not retried: it would only stall again
    stacks = open(os.path.join(run_dir, "stacks.txt")).read()
    assert "==== host 0 (trainer" in stacks and "==== host 1 (inference" in stacks
    assert "in point" in stacks and "faults.py" in stacks  # the trainer's main thread, where it hangs
    assert "_replica_loop" in stacks  # the inference host's decode thread, still serving
    assert [r["step"] for r in rows(run_dir)] == [1, 2]


def test_a_host_killed_during_startup_is_restarted(tmp_path):
    """Host 1 dies while joining jax.distributed (`ASYNCRL_FAULTS`): before, the driver's ray.get raised a bare
    RayActorError and the run exited 1 whatever run.max_restarts said; now startup is part of the attempt."""
    run_dir = str(tmp_path / "run")
    res = launch(run_dir, *TINY, "train.total_steps=3", "run.max_restarts=1", "eval.every_n_steps=0",
                 "checkpoint.every_n_steps=0", env_extra={"ASYNCRL_FAULTS": "kill@startup:1:0"}, timeout=600)
    err = res.stderr
    assert res.returncode == 0, err[-4000:]
    assert "fault injection: kill at startup (rank 1, step 0)" in err
    assert "host 1 (inference) failed: died during the jax.distributed join" in err and "restarting" in err, err[-3000:]
    assert [r["step"] for r in rows(run_dir)] == [1, 2, 3]
