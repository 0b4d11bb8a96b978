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


# The default suite runs it with A trained; A frozen is in the slow suite (the same launch count as before the two
# tests were one: an export run each in the default suite, a straight and a resumed run each in the slow one).
@pytest.mark.parametrize("freeze_a", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_lora_run_syncs_adapters_alone_exports_for_peft_and_resumes_exactly(tmp_path, freeze_a):
    """One LoRA run of 9 steps, uninterrupted: the first weight sync carries the base and the adapters, every later
    one the adapters alone (B alone with A frozen); the KL reference (the base) differs from the policy; the run
    exports the adapters for PEFT and the merged model. Then the same run with a trainer SIGKILL at step 7, which
    restarts from its step-6 checkpoint. At max_lag 0 the run is deterministic, so the final adapters must equal
    the uninterrupted run's bit for bit: every update after the resume depends on the restored adapters, their
    Adam moments (restored, not re-initialised) and the KL reference (the base, rebuilt from the cached
    warm-start). (One test, so that CI builds the uninterrupted run once.)"""
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    args = [*LORA, "train.total_steps=9", f"train.lora.freeze_a={freeze_a}"]
    res = launch(straight, *args)
    assert res.returncode == 0, res.stderr[-4000:]
    r = rows(straight)
    assert [x["step"] for x in r] == list(range(1, 10))
    cfg = preset("tiny")
    from omegaconf import OmegaConf

    dtype = OmegaConf.load(os.path.join(straight, "config.yaml")).inference.params_dtype  # both travel in it
    first_bytes = np.dtype(dtype).itemsize * lora.count(cfg, 8, tuple(lora.TARGETS))
    adapter_bytes = np.dtype(dtype).itemsize * lora.count(cfg, 8, tuple(lora.TARGETS), ("b",) if freeze_a else "ab")
    base_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params_lib.shapes(cfg, dtype)))
    sync = [x["weight_sync_bytes"] for x in r]
    assert sync[0] == base_bytes + first_bytes and set(sync[1:]) == {adapter_bytes}, sync
    kl_a = [x["train/kl"] for x in r]
    assert all(np.isfinite(kl_a)) and max(kl_a) > 0  # the reference (the base) differs from the trained policy
    with open(os.path.join(straight, "hf_adapter", "adapter_config.json")) as f:
        conf = json.load(f)
    assert conf["peft_type"] == "LORA" and conf["r"] == 8 and conf["lora_alpha"] == 16.0
    ad = lora.from_peft_tensors(cfg, _tensors(os.path.join(straight, "hf_adapter", "adapter_model.safetensors")), 8,
                                tuple(lora.TARGETS))
    assert all(np.abs(p["b"]).max() > 0 for p in ad.values())  # trained: B moved off its zero init
    assert os.path.isfile(os.path.join(straight, "hf", "model.safetensors"))  # the merged model

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
    kl_b = [x["train/kl"] for x in rows(resumed)]
    assert kl_a == kl_b
