"""Test-wide setup. Fake CPU devices must be configured before JAX touches a backend, so it happens here."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: heavy test (real model, multi-process); deselect with -m 'not slow'")


# The default-suite modules whose tests start local Ray clusters (launch.py runs, ray.init). Under `-n 2 --dist
# loadfile` one worker runs them all, one at a time: test_orchestration_e2e asserts that every Ray process its run
# started is gone afterwards, and would count another worker's.
RAY_MODULES = {"test_failures.py", "test_lora_run.py", "test_orchestration_e2e.py", "test_own_environment.py"}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`pytest -n 2 --dist loadfile` (.ci/run's default suite): each module is one unit of work, as xdist's loadfile
    makes it, so that its module fixtures are built, and the programs its tests share compiled, in one worker only;
    and the Ray modules are one unit together. (xdist's `--dist loadgroup` cannot express this under pytest 9: it
    renames `item._nodeid`, which pytest 9 no longer reads.) Any other `--dist` is xdist's own."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "ray" if os.path.basename(module) in RAY_MODULES else module

    return ModuleScheduling(config, log)


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
