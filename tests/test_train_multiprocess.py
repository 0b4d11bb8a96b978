"""Two processes x 4 fake CPU devices (jax.distributed over gloo), each feeding its local half of the batch,
train exactly like one process on the whole batch."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from asyncrl.models import save_pretrained
from asyncrl.train.batch import build_batch
from asyncrl.train.config import MeshConfig, ShardingConfig
from asyncrl.train.trainer import Trainer
from tests.helpers import multihost_setup, random_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_match_one(tmp_path):
    out = tmp_path / "worker0.npz"
    port = _free_port()
    setup = multihost_setup()
    hf = str(tmp_path / "hf")
    save_pretrained(setup.model, random_params(setup.model.cfg, seed=7), hf)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "train_multiprocess_worker.py"),
                               "--process-id", str(i), "--port", str(port), "--out", str(out), "--hf", hf],
                              env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=600)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"worker {i} failed:\n{log[-4000:]}"
        assert "LOADED ok=True" in log, log[-3000:]  # a folder's weights onto a mesh spanning both processes

    ref = Trainer(setup.model, setup.train_cfg, setup.loss_cfg,
                  ShardingConfig(mesh=MeshConfig(dp=1, fsdp=1), min_bytes_for_fsdp=0), devices=jax.devices()[:1])
    ref.init(jax.random.key(0))
    ref_metrics = []
    for rollouts in setup.steps:
        m = ref.step(build_batch(rollouts, setup.loss_cfg, setup.train_cfg.pad_to_multiple))
        m.pop("train/step_time_s")
        ref_metrics.append(m)

    got = np.load(out)
    history = json.loads(str(got["metrics"]))
    for step, (mine, theirs) in enumerate(zip(ref_metrics, history)):
        assert theirs["rollout/lag_max"] == 1 + step and theirs["rollout/filtered_lag"] == 2  # combined over hosts
        for k in mine:
            assert theirs[k] == pytest.approx(mine[k], rel=1e-5, abs=1e-6), (step, k)
    for path, leaf in jax.tree_util.tree_leaves_with_path(ref.params):
        np.testing.assert_allclose(got[jax.tree_util.keystr(path)], np.asarray(leaf), atol=1e-5, rtol=0,
                                   err_msg=jax.tree_util.keystr(path))
