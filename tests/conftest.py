"""Test-wide setup. Fake CPU devices must be configured before JAX touches a backend, so it happens here."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: heavy test (real model, multi-process); deselect with -m 'not slow'")
    if not (config.getoption("numprocesses", None) and not hasattr(config, "workerinput")):  # not xdist's controller
        _in_process_compile_cache()


def _in_process_compile_cache() -> None:
    """A persistent JAX compilation cache for the programs this pytest process compiles, in a temp folder of its own
    (each xdist worker's), set before anything compiles (JAX decides once per process whether to use it). Tests build
    many trainers and engines of the same shapes, each with jitted functions of its own that compile the same
    programs again: five in-process modules took 7:14 (660 CPU-s) without it and 5:24 (471 CPU-s) with it, from an
    empty cache (2026-12-07). Set through jax.config, not the environment: the processes tests start (launch.py runs,
    the multi-process workers) keep their own settings (`helpers.launch_env`). Tests that count compilations count
    the cache's hits with them (`test_compile_stability_after_warmup`). ASYNCRL_TEST_IN_PROCESS_CACHE=0: off."""
    if os.environ.get("ASYNCRL_TEST_IN_PROCESS_CACHE", "1") == "0":
        return
    import atexit
    import shutil
    import tempfile

    import jax

    path = tempfile.mkdtemp(prefix="asyncrl-jax-cache-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_addoption(parser):
    parser.addoption("--ray-unit", choices=("all", "only", "none"), default="all",
                     help="run the tests that start local Ray clusters (RAY_MODULES, RAY_TESTS) with the others "
                          "(all), alone (only), or leave them out (none)")


def pytest_collection_modifyitems(config, items):
    which = config.getoption("--ray-unit")
    if which == "all":
        return
    keep, drop = [], []
    for it in items:
        (keep if (unit_of(it.nodeid) == RAY_UNIT) == (which == "only") else drop).append(it)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


# The tests that start local Ray clusters (launch.py runs, ray.init, `ray start`), default and slow: whole modules,
# and single tests of modules whose other tests run in one process. Under `-n 2 --dist loadfile` they are one unit
# of work, which one worker runs one test at a time while the other runs the in-process modules beside it:
# test_orchestration_e2e asserts that every Ray process its run started is gone afterwards (another worker's would
# count), and the multi-process runs' waits and timeouts are sized for one run at a time (two at once put the load
# at 7-8 on 2 cores and finished no sooner, 2026-12-07).
RAY_MODULES = {"test_agent_run.py", "test_chaos.py", "test_console.py", "test_dashboard.py", "test_failures.py",
               "test_local_default.py", "test_lora_run.py", "test_orchestration_e2e.py",
               "test_orchestration_resilience.py", "test_own_environment.py", "test_plan_from_run.py",
               "test_rollout_tokens.py"}
RAY_TESTS = {"test_lookup_learning.py::test_three_hosts_with_max_lag_2_train_multi_turn_episodes"}
RAY_UNIT = "ray"


def unit_of(nodeid: str) -> str:
    """The unit of work of a test under `-n 2 --dist loadfile`: its module, or the Ray unit."""
    module, _, name = nodeid.partition("::")
    base = os.path.basename(module)
    if base in RAY_MODULES or f"{base}::{name.split('[', 1)[0]}" in RAY_TESTS:
        return RAY_UNIT
    return module


# Under the packing below, the worker that runs in-process modules lowers its CPU priority at its first test. The Ray
# unit is CI's critical path (its tests run one after another, for most of pytest's wall time), and Ray starts its
# worker processes, our host actors, at niceness 15 (`RAY_worker_niceness`, so that its own daemons stay responsive):
# beside an in-process test at 0, a host got 36/1060 of a contended core (CFS weights), and a Ray test took 2-4x its
# time alone (the chaos test's two-trainer run 420-470 s against 217 s). At 10 the in-process worker still gets
# 110/146 of a core both want, and finishes last already (measured at 10, with the compilation cache below: the Ray
# unit done at ~36 of 39 min); at 19 (15/51) it would finish later still (not measured). None of the in-process tests
# has a time limit that waiting could hit.
IN_PROCESS_NICE = 10
_niced = False


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """On the controller: tells each xdist worker whether the packing below is on (a worker's own `dist` is "no")."""
    node.workerinput["asyncrl_packed"] = node.config.getvalue("dist") == "loadfile"


def pytest_runtest_setup(item):
    global _niced
    if _niced or not getattr(item.config, "workerinput", {}).get("asyncrl_packed") or unit_of(item.nodeid) == RAY_UNIT:
        return
    _niced = True
    # Linux keeps a niceness per thread, and new threads and processes inherit their creator's: every thread of this
    # worker that exists now (XLA's pools among them), and so everything they start later.
    for tid in os.listdir("/proc/self/task"):
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid), max(os.getpriority(os.PRIO_PROCESS, int(tid)), IN_PROCESS_NICE))
        except (OSError, ValueError):
            pass


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`pytest -n 2 --dist loadfile` (.ci/run: the whole suite, slow tests included): each module is one unit of
    work, as xdist's loadfile makes it, so that its module fixtures are built, and the programs its tests share
    compiled, in one worker only; and the Ray tests are one unit together, handed out first: it is by far the
    longest, and the in-process modules fill the other worker beside it (a multi-process run alone keeps ~1.35 of
    the 2 cores busy). (xdist's `--dist loadgroup` cannot express this under pytest 9: it renames `item._nodeid`,
    which pytest 9 no longer reads.) Any other `--dist` is xdist's own."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

        def _assign_work_unit(self, node) -> None:
            if RAY_UNIT in self.workqueue:
                self.workqueue.move_to_end(RAY_UNIT, last=False)
            super()._assign_work_unit(node)

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


@pytest.fixture(scope="session", autouse=True)
def launch_compile_cache(tmp_path_factory):
    """The JAX compilation cache that the session's single-trainer launch.py runs share (`helpers.launch_env`),
    emptied with the session's temp folder. (Under xdist, each worker's own: the Ray unit runs in one.)"""
    from tests.helpers import COMPILE_CACHE_VAR

    os.environ[COMPILE_CACHE_VAR] = str(tmp_path_factory.mktemp("jax-compile-cache"))
