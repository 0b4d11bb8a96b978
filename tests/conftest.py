"""Test-wide setup. Fake CPU devices must be configured before JAX touches a backend, so it happens here."""

import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One JAX persistent compilation cache for the whole session, inherited by every subprocess and Ray actor that a
# test starts: many tests compile the same tiny-model programs (an engine per test, a trainer per launch, a host
# again after each restart), and CI's time goes largely to XLA compiles. A cache hit returns the executable that
# the same HLO compiled to, so results are unchanged. JAX writes entries from jax process 0 only (the trainer in a
# multi-host run); the others compile as before.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="asyncrl-test-jax-cache-")
_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"]
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import pytest  # noqa: E402


def pytest_unconfigure(config):
    if os.path.basename(_CACHE).startswith("asyncrl-test-jax-cache-"):  # ours, not one the caller named
        shutil.rmtree(_CACHE, ignore_errors=True)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: heavy test (real model, multi-process); deselect with -m 'not slow'")


# Shared by the engine tests (test_inference_engine.py, test_multiturn.py): the character tokenizer and the tiny
# model with seed-0 weights, built once per module.
@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from asyncrl.models.tokenizer import Tokenizer, build_char_tokenizer

    return Tokenizer.from_folder(build_char_tokenizer(str(tmp_path_factory.mktemp("tok") / "char")))


@pytest.fixture(scope="module")
def model_params():
    import jax

    from asyncrl.models import Model, preset

    model = Model(preset("tiny"))
    return model, model.init_params(jax.random.PRNGKey(0))
