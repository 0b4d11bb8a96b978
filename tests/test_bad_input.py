"""Bad inputs fail at once with one clear exception that names the file, key or tensor."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from asyncrl.config.loader import load_config
from asyncrl.models import CheckpointError, ModelConfigError, from_pretrained, save_pretrained
from asyncrl.models.safetensors_io import SafetensorsFile, save_file
from asyncrl.validate import ConfigError
from tests.helpers import save_hf_model


@pytest.fixture(scope="module")
def good_folder(tmp_path_factory):
    f = str(tmp_path_factory.mktemp("good"))
    save_hf_model("qwen3_untied", f)
    return f


def _copy(src, dst):
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        with open(os.path.join(src, name), "rb") as a, open(os.path.join(dst, name), "wb") as b:
            b.write(a.read())
    return dst


def test_no_config_json(tmp_path):
    with pytest.raises(ModelConfigError, match=r"config\.json"):
        from_pretrained(str(tmp_path))


def test_unsupported_architecture(good_folder, tmp_path):
    d = _copy(good_folder, str(tmp_path / "m"))
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["architectures"] = ["MistralForCausalLM"]
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(ModelConfigError, match=r"config\.json.*MistralForCausalLM"):
        from_pretrained(d)


def _rewrite(folder, mutate):
    path = os.path.join(folder, "model.safetensors")
    f = SafetensorsFile(path)
    tensors = {k: np.array(f.get(k)) for k in f.keys()}
    mutate(tensors)
    del f
    save_file(tensors, path)


def test_missing_tensor(good_folder, tmp_path):
    d = _copy(good_folder, str(tmp_path / "m"))
    _rewrite(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*model\.layers\.1\.mlp\.up_proj\.weight.*missing"):
        from_pretrained(d)


def test_wrong_shape(good_folder, tmp_path):
    d = _copy(good_folder, str(tmp_path / "m"))

    def cut(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:-1]

    _rewrite(d, cut)
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight.*shape"):
        from_pretrained(d)


def test_no_weights_file(good_folder, tmp_path):
    d = _copy(good_folder, str(tmp_path / "m"))
    os.remove(os.path.join(d, "model.safetensors"))
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        from_pretrained(d)


def test_missing_shard_named(good_folder, tmp_path):
    model, params = from_pretrained(good_folder)
    d = str(tmp_path / "sharded")
    save_pretrained(model, params, d, max_shard_bytes=50_000)
    victim = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))[-1]
    os.remove(os.path.join(d, victim))
    with pytest.raises(CheckpointError, match=victim):
        from_pretrained(d)


@pytest.mark.parametrize(
    "override,pattern",
    [
        ("inference.temperature", "malformed"),  # no '='
        ("inference.temprature=1.0", r"inference\.temprature"),  # unknown key
        ("inference.temperature=hot", r"inference\.temperature"),  # wrong type
        ("inference.temperature=-0.5", r"inference\.temperature=-0\.5.*>= 0"),  # out of range
        ("loss=not_a_loss", r"loss='not_a_loss'.*one of"),  # unknown preset
        ("async.train_workers=5", r"async\.train_workers=5"),  # role split impossible
        ("sharding.mesh.fsdp=0", r"sharding\.mesh\.fsdp=0"),
        ("sharding.mesh.expert=0", r"sharding\.mesh\.expert=0"),
        ("train.grad_accum_steps=7", r"train\.grad_accum_steps=7"),
        ("train.updates_per_step=3", r"train\.updates_per_step=3"),
        # CISPO on top of the grpo preset would keep its epsilon_high=0.2: a cap of 0.2 on every IS weight.
        ("loss.name=cispo", r"loss\.epsilon_high=0\.2 is invalid for loss\.name=cispo.*learning-rate cut"),
        ("loss.is_mode=truncate", r"loss\.tis_cap=None.*is_mode=truncate"),
        ("loss.overlong_buffer=31", r"loss\.overlong_buffer=31.*< loss\.max_tokens=31"),  # the whole budget
        ("logging.progress_every_n_steps=0", r"logging\.progress_every_n_steps=0.*>= 1"),
        ("inference.decode_feed_tokens=-1", r"inference\.decode_feed_tokens=-1.*>= 0"),
        ("run.metrics_export_port=70000", r"run\.metrics_export_port=70000.*port"),
    ],
)
def test_malformed_config_override(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config("default", [override])


def test_overrides_compose():
    cfg = load_config("default", ["loss=dr_grpo", "inference.temperature=0.7", "async.max_lag=3", "model=qwen3-1.7b"])
    assert cfg.loss.name == "dr_grpo" and cfg.loss.epsilon_high == pytest.approx(0.28)
    assert cfg.inference.temperature == 0.7
    assert cfg.async_.max_lag == 3
    assert cfg.model.preset == "qwen3-1.7b"


def test_generation_budget_fills_the_loss():
    """Dr.GRPO's constant normaliser and the overlong buffer read the run's generation budget, never the batch's
    padded length: max_new_tokens plus its EOS slot, else max_seq_len less a one-token prompt."""
    assert load_config("default", ["loss=dr_grpo"]).loss.max_tokens == 31  # default max_seq_len: 32
    assert load_config("default", ["loss=dr_grpo", "inference.max_new_tokens=20"]).loss.max_tokens == 21
    assert load_config("default", ["loss=dr_grpo", "loss.max_tokens=4096"]).loss.max_tokens == 4096
    cfg = load_config("default", ["loss=dapo", "loss.overlong_buffer=8", "loss.overlong_filter=true"])
    assert (cfg.loss.max_tokens, cfg.loss.overlong_buffer, cfg.loss.overlong_filter) == (31, 8, True)


def test_every_yaml_preset_loads():
    from asyncrl.config.loader import groups

    for group, options in groups().items():
        for opt in options:
            if group == "model" and opt == "hf":
                continue  # needs model.path
            load_config("default", [f"{group}={opt}"])
    with pytest.raises(ConfigError, match=r"model\.path"):
        load_config("default", ["model=hf"])


def test_smollm2_preset_loads_and_its_task_reads_both_answer_formats():
    from asyncrl.envs import build_task

    cfg = load_config("smollm2_arithmetic")
    assert cfg.model.source == "smollm2" and cfg.train.remat and cfg.inference.temperature == 0.7
    task = build_task(cfg.task)
    sample = next(task.samples("eval", cfg.task.seed))
    assert task.score(f"so \\boxed{{{sample.answer}}}", sample).reason == "correct"
    assert task.score(f"The final answer is {sample.answer}.", sample).reason == "correct"
    assert task.score(f"It is {sample.answer}.", sample).reason == "no_answer"


def test_model_config_validation():
    from asyncrl.models.config import ModelConfig

    with pytest.raises(ModelConfigError, match="num_kv_heads"):
        ModelConfig(num_heads=4, num_kv_heads=3)
    _ = jnp.zeros(1)
