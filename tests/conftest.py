"""Test-wide setup. Fake CPU devices must be configured before JAX touches a backend, so it happens here."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


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
