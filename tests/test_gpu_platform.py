"""`run.platform: gpu` in the driver (orchestration/driver.py): each host actor takes its GPUs through Ray and runs
on JAX's CUDA backend, never the simulated CPU hosts' settings. No GPU here: the actor options are checked."""

import pytest

from asyncrl.config.loader import load_config
from asyncrl.orchestration.driver import gpu_host_options, host_env
from asyncrl.validate import ConfigError


def test_gpu_hosts_take_their_gpus_and_the_cuda_backend():
    cfg = load_config("default", ["run.platform=gpu", "run.devices_per_host=4"])
    opts = gpu_host_options(cfg.driver_config(), host_env())
    assert opts["num_gpus"] == 4 and opts["num_cpus"] == 1
    env = opts["runtime_env"]["env_vars"]
    assert env["JAX_PLATFORMS"] == "cuda"
    assert "XLA_FLAGS" not in env  # the fake-CPU-device flag is the simulated hosts' only
    assert env["PYTHONPATH"] == host_env()["PYTHONPATH"]


def test_an_unknown_platform_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match="run.platform"):
        load_config("default", ["run.platform=rocm"])


def test_cpu_hosts_drop_a_users_compile_cache_with_two_trainers(monkeypatch):
    """Two CPU trainers restarting from a shared persistent cache ran mismatched gloo collectives (driver.py): the
    hosts of such a run switch the cache off; one trainer keeps it; no user cache, nothing added."""
    from asyncrl.orchestration.driver import cpu_host_env

    two = load_config("default", ["run.hosts=4", "async.train_workers=2"]).driver_config()
    one = load_config("default", ["run.hosts=3", "async.train_workers=1"]).driver_config()
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    assert "JAX_ENABLE_COMPILATION_CACHE" not in cpu_host_env(two)
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/tmp/some-cache")
    assert cpu_host_env(two)["JAX_ENABLE_COMPILATION_CACHE"] == "false"
    assert "JAX_ENABLE_COMPILATION_CACHE" not in cpu_host_env(one)
    assert cpu_host_env(one)["JAX_PLATFORMS"] == "cpu"
