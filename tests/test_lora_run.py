"""LoRA through `python launch.py`: adapters-only weight syncs after the first, the PEFT export, and a kill and
resume that keeps the adapters, their optimizer state and the KL reference (the base)."""

import json
import os
import re

import jax
import numpy as np
import pytest

from asyncrl.models import lora, params as params_lib, preset
from asyncrl.models.safetensors_io import SafetensorsFile
from tests.helpers import TINY, launch, rows

LORA = [*TINY, "train.format_warmstart_steps=150", "train.lora.rank=8", "train.lr=1e-3", "loss.kl_coef=0.05",
        "async.max_lag=0", "checkpoint.every_n_steps=2", "checkpoint.export_hf=true", "eval.every_n_steps=0",
        "run.seed=3"]


def _tensors(path):
    f = SafetensorsFile(path)
    return {k: np.array(f.get(k)) for k in f.keys()}


@pytest.mark.parametrize("freeze_a", [False, True])
def test_lora_run_syncs_the_adapters_alone_and_exports_them_for_peft(tmp_path, freeze_a):
    run_dir = str(tmp_path / "run")
    res = launch(run_dir, *LORA, f"train.lora.freeze_a={freeze_a}")
    assert res.returncode == 0, res.stderr[-4000:]
    r = rows(run_dir)
    assert [x["step"] for x in r] == [1, 2, 3, 4, 5, 6]
    cfg = preset("tiny")
    from omegaconf import OmegaConf

    dtype = OmegaConf.load(os.path.join(run_dir, "config.yaml")).inference.params_dtype  # both travel in it
    first_bytes = np.dtype(dtype).itemsize * lora.count(cfg, 8, tuple(lora.TARGETS))
    adapter_bytes = np.dtype(dtype).itemsize * lora.count(cfg, 8, tuple(lora.TARGETS), ("b",) if freeze_a else "ab")
    base_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params_lib.shapes(cfg, dtype)))
    sync = [x["weight_sync_bytes"] for x in r]
    assert sync[0] == base_bytes + first_bytes and set(sync[1:]) == {adapter_bytes}, sync
    kl = [x["train/kl"] for x in r]
    assert all(np.isfinite(kl)) and max(kl) > 0  # the reference (the base) differs from the trained policy
    with open(os.path.join(run_dir, "hf_adapter", "adapter_config.json")) as f:
        conf = json.load(f)
    assert conf["peft_type"] == "LORA" and conf["r"] == 8 and conf["lora_alpha"] == 16.0
    ad = lora.from_peft_tensors(cfg, _tensors(os.path.join(run_dir, "hf_adapter", "adapter_model.safetensors")), 8,
                                tuple(lora.TARGETS))
    assert all(np.abs(p["b"]).max() > 0 for p in ad.values())  # trained: B moved off its zero init
    assert os.path.isfile(os.path.join(run_dir, "hf", "model.safetensors"))  # the merged model


@pytest.mark.slow
@pytest.mark.parametrize("freeze_a", [False, True])
def test_lora_kill_and_resume_equals_uninterrupted(tmp_path, freeze_a):
    """A trainer SIGKILL at step 7 restarts the run from its step-6 checkpoint. At max_lag 0 the run is
    deterministic, so the final adapters must equal an uninterrupted run's bit for bit: every update after the
    resume depends on the restored adapters, their Adam moments (restored, not re-initialised) and the KL
    reference (the base, rebuilt from the cached warm-start)."""
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    args = [*LORA, "train.total_steps=9", f"train.lora.freeze_a={freeze_a}"]
    res = launch(straight, *args)
    assert res.returncode == 0, res.stderr[-4000:]
    res = launch(resumed, *args, "run.max_restarts=1", env_extra={"ASYNCRL_FAULTS": "kill@step:0:7"})
    assert res.returncode == 0, res.stderr[-4000:]
    resumed_at = [int(x) for x in re.findall(r"resuming .* from checkpoint step (\d+)", res.stderr)]
    assert resumed_at == [6], res.stderr[-3000:]
    assert [x["step"] for x in rows(resumed)] == list(range(1, 10))
    for name in ("hf_adapter/adapter_model.safetensors", "hf/model.safetensors"):
        a, b = _tensors(os.path.join(straight, name)), _tensors(os.path.join(resumed, name))
        assert a.keys() == b.keys()
        for k in a:
            np.testing.assert_array_equal(a[k], b[k], err_msg=f"{name}: {k}")
    kl_a = [x["train/kl"] for x in rows(straight)]
    kl_b = [x["train/kl"] for x in rows(resumed)]
    assert kl_a == kl_b and max(kl_a) > 0
