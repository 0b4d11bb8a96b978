"""`asyncrl/aot/libtpu.py`: on a machine with libtpu installed and no TPU, `launch.py aot` prints its own lines
only (libtpu's five start-up error lines, "E0000 ... INVALID_ARGUMENT", used to come first); a TPU host, or a user
who set libtpu's variables, is left alone."""

import os
import re
import subprocess
import sys

import pytest

from asyncrl.aot import libtpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _has_libtpu() -> bool:
    try:
        import libtpu as _  # noqa: F401
    except ImportError:
        return False
    return True


def _user_env() -> dict[str, str]:
    """The environment of a user's shell: none of what conftest (fake CPU devices), `import jax` in this process
    (TPU_SKIP_MDS_QUERY, TPU_LIBRARY_PATH) or the helper under test put into ours."""
    drop = ("XLA_FLAGS", "JAX_PLATFORMS", "ALLOW_MULTIPLE_LIBTPU_LOAD")
    return {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("TPU_")}


# Our own stderr lines during `launch.py aot` (asyncrl/cli/aot.py's progress); anything else is someone else's.
_PROGRESS = re.compile(r"^(\[\d+/\d+\] compiling \S+ over \d+ v5p chips \.\.\.|"
                       r"      \d+\.\ds, peak \d+\.\d\d GiB per chip)$")
_LIBTPU = re.compile(r"libtpu|TPU_ACCELERATOR_TYPE|TPU_WORKER_HOSTNAMES|InitGoogle|Source Location Trace|"
                     r"host bounds|^[IWEF]\d{4} ")


@pytest.mark.skipif(not _has_libtpu() or libtpu.tpu_attached(), reason="needs libtpu installed and no TPU attached")
def test_aot_prints_the_table_and_nothing_from_libtpu(tmp_path):
    env = _user_env() | {"ASYNCRL_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "launch.py", "aot", "--config-name", "tpu_tiny"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    # libtpu's own log files go under the cache, not to /tmp/tpu_logs, which a local Ray run streams to its console.
    assert any(f.name.startswith("tpu_driver") for f in (tmp_path / "tpu_logs").iterdir())
    foreign = [ln for ln in (out.stdout + out.stderr).splitlines() if _LIBTPU.search(ln)]
    assert not foreign, foreign
    err = out.stderr.splitlines()
    assert err and all(_PROGRESS.match(ln) for ln in err), err
    lines = out.stdout.splitlines()
    assert lines[0].startswith("tpu-tiny on v5p:2x2x1: memory per chip"), lines[:3]
    assert lines[1].split()[:3] == ["program", "chips", "args"] and set(lines[2]) <= {"-", " "}
    programs = [ln.split()[0] for ln in lines[3:]]
    assert programs[:3] == ["train_step", "weight_sync_cast", "decode"] and programs[3].startswith("prefill["), lines
    assert all(ln.split()[10] == "yes" for ln in lines[3:]), lines  # the "fits" column


@pytest.mark.skipif(not _has_libtpu() or libtpu.tpu_attached(), reason="needs libtpu installed and no TPU attached")
def test_a_users_persistent_compilation_cache_adds_nothing_to_the_console(tmp_path):
    """A compile-only client cannot load executables back: with JAX_COMPILATION_CACHE_DIR set, the second run
    printed JAX's 'Error reading persistent compilation cache entry' warning for every program. aot runs without
    the cache."""
    env = _user_env() | {"ASYNCRL_CACHE": str(tmp_path), "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax"),
                         "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    for _ in range(2):
        out = subprocess.run([sys.executable, "launch.py", "aot", "--config-name", "tpu_tiny", "--programs", "decode"],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        assert out.returncode == 0, out.stderr[-3000:]
        assert all(_PROGRESS.match(ln) for ln in out.stderr.splitlines()), out.stderr[-3000:]


def _clear(monkeypatch, attached: bool) -> None:
    monkeypatch.setattr(libtpu, "tpu_attached", lambda: attached)
    for key in (*libtpu._USER_TPU_ENV, "TPU_LOG_DIR"):
        monkeypatch.delenv(key, raising=False)


def test_a_variable_the_user_set_keeps_its_value_and_the_rest_stay_unset(monkeypatch):
    _clear(monkeypatch, attached=False)
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v6e-8")
    assert libtpu.quiet_libtpu_without_tpu() is False
    assert os.environ["TPU_ACCELERATOR_TYPE"] == "v6e-8"
    assert "TPU_WORKER_HOSTNAMES" not in os.environ and "TPU_LOG_DIR" not in os.environ


def test_a_log_dir_the_user_set_is_kept(monkeypatch):
    _clear(monkeypatch, attached=False)
    monkeypatch.setenv("TPU_LOG_DIR", "/var/log/mine")
    assert libtpu.quiet_libtpu_without_tpu() is True
    assert os.environ["TPU_LOG_DIR"] == "/var/log/mine"


def test_a_tpu_host_is_left_alone(monkeypatch):
    _clear(monkeypatch, attached=True)
    assert libtpu.quiet_libtpu_without_tpu() is False
    assert not any(k in os.environ for k in (*libtpu._QUIET_ENV, "TPU_LOG_DIR"))


def test_no_tpu_and_no_user_variables_sets_them_all(monkeypatch, tmp_path):
    _clear(monkeypatch, attached=False)
    monkeypatch.setenv("ASYNCRL_CACHE", str(tmp_path))
    assert libtpu.quiet_libtpu_without_tpu() is True
    assert {k: os.environ[k] for k in libtpu._QUIET_ENV} == libtpu._QUIET_ENV
    assert os.environ["TPU_LOG_DIR"] == str(tmp_path / "tpu_logs")
