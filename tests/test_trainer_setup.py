"""Building a trainer host's Trainer (`orchestration/trainer_setup.py`), in-process: the KL reference is part of
the run's durable state, restored on every resume, never the random init."""

from __future__ import annotations

import dataclasses
import os
import shutil

import jax
import numpy as np
import pytest

from asyncrl.config.loader import load_config
from asyncrl.orchestration import trainer_setup
from asyncrl.sharding.roles import split_roles
from tests.helpers import make_rollouts


def _cfg(run_dir, **kw):
    # The local default's model and warm-start (cached under ~/.cache/asyncrl), with the KL term on.
    over = ["loss.kl_coef=0.1", f"run.run_dir={run_dir}", "checkpoint.every_n_steps=1", "train.train_batch_size=16",
            "inference.group_size=4", "run.devices_per_host=2", "train.format_warmstart_steps=20"]
    return load_config("default", [*over, *(f"{k}={v}" for k, v in kw.items())])


@pytest.fixture
def two_hosts(monkeypatch):
    """This process's first 4 devices as two simulated hosts of 2 (trainer, inference)."""
    monkeypatch.setattr(trainer_setup, "split_roles",
                        lambda devices, tw: split_roles(list(devices)[:4], tw, hosts=2))


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_the_kl_reference_survives_a_resume(tmp_path, two_hosts):
    """Before: a resume rebuilt the trainer from the random init, skipped the warm-start (it had run already) and
    loaded the checkpoint's params, so `ref_params` was the random init: train/kl jumped (0.3 -> 4.5 in a run)."""
    run_dir = str(tmp_path / "run")
    cfg = _cfg(run_dir)
    trainer, ckpt, meta = trainer_setup.build_trainer(cfg.trainer_role(), run_dir)
    assert meta == {}
    reference = _leaves(trainer.ref_params)
    from asyncrl.train.batch import build_batch

    batch = build_batch(make_rollouts(0, 4, 4, trainer.model.cfg.vocab_size), cfg.loss, cfg.train.pad_to_multiple)
    trainer.step(batch)
    ckpt.save(1, trainer.params, trainer.opt_state, {**trainer.state_dict(), "position": 4, "in_flight": []})
    ckpt.close()

    resumed = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, resume=True))
    again, ckpt2, meta = trainer_setup.build_trainer(resumed.trainer_role(), run_dir)
    ckpt2.close()
    assert meta["step"] == 1 and again.step_count == 1
    for a, b in zip(_leaves(again.ref_params), reference):
        np.testing.assert_array_equal(a, b)  # the warm-started start, exactly
    assert any(not np.array_equal(a, b) for a, b in zip(_leaves(again.params), reference))  # the policy moved

    # A run directory without the saved reference (written before it was kept) rebuilds it: the same start.
    shutil.rmtree(os.path.join(run_dir, trainer_setup.REFERENCE_DIR))
    rebuilt, ckpt3, _ = trainer_setup.build_trainer(resumed.trainer_role(), run_dir)
    ckpt3.close()
    for a, b in zip(_leaves(rebuilt.ref_params), reference):
        np.testing.assert_array_equal(a, b)
