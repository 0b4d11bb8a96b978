"""An environment from the user's own package (`asyncrl/envs/registry.py`, `asyncrl/orchestration/plugins.py`): named
by import path, imported by the driver before anything starts, shipped to every host through Ray's runtime_env."""

import json
import os
import pathlib
import re
import resource
import sys
import textwrap
import time

import pytest

from asyncrl.envs import EnvironmentSpec, resolve
from asyncrl.orchestration.plugins import import_environments, package_path
from asyncrl.tasks import TaskConfig, TaskSourceConfig
from asyncrl.validate import ConfigError
from tests.helpers import TINY, launch, rows

ROOT = pathlib.Path(__file__).resolve().parent.parent


def readme_environment() -> str:
    """The environment file the README's "Your own environment" shows, verbatim: the test runs what users read."""
    text = (ROOT / "README.md").read_text()
    m = re.search(r"\n( *)```python\n\1# count_env/env\.py.*?\n\1```\n", text, re.S)
    assert m, "README.md has no count_env/env.py example"
    return textwrap.dedent(m.group(0).strip("\n")).split("\n", 1)[1].rsplit("\n", 1)[0] + "\n"


# Test-only: the README's environment whose task factory also leaves a marker (this process, and the file the module
# was imported from) in `options.marker_dir`, so the test sees every host import it, and from where.
MARKED = """
import os

from asyncrl.envs import EnvironmentSpec
from count_env import env


def make_task(source, task_config, where):
    with open(os.path.join(source.options["marker_dir"], f"{os.getpid()}.txt"), "w") as f:
        f.write(env.__file__)
    return env.make_task(source, task_config, where)


ENVIRONMENT = EnvironmentSpec(task=make_task)
"""


def write_package(root):
    pkg = root / "count_env"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "env.py").write_text(readme_environment())
    (pkg / "marked.py").write_text(MARKED)
    return pkg


@pytest.fixture
def user_pkg(tmp_path, monkeypatch):
    """The package in a folder of its own, outside the repo, on this process's path (as PYTHONPATH puts it)."""
    root = tmp_path / "user"
    pkg = write_package(root)
    monkeypatch.syspath_prepend(str(root))
    yield pkg
    for mod in [m for m in sys.modules if m == "count_env" or m.startswith("count_env.")]:
        del sys.modules[mod]


def test_a_user_environment_is_resolved_and_its_package_is_shipped(user_pkg):
    cfg = TaskConfig(sources=[TaskSourceConfig(environment="count_env.env:ENVIRONMENT"),
                              TaskSourceConfig(environment="digits")])
    assert isinstance(resolve("count_env.env:ENVIRONMENT", "k"), EnvironmentSpec)
    assert import_environments(cfg) == [str(user_pkg)]  # the user's folder, once; asyncrl's own is never shipped
    assert package_path("asyncrl.envs.digits") is None and package_path("yaml") is None  # installed: not shipped


@pytest.mark.parametrize("name, message", [
    ("count_env.nope:ENVIRONMENT", "cannot import 'count_env.nope'"),
    ("count_env.env:MISSING", "'count_env.env' has no attribute 'MISSING'"),
    ("count_env.env:CountTask", "count_env.env:CountTask is a class, not an asyncrl.envs.EnvironmentSpec"),
    ("count_env.marked:os", "count_env.marked:os is a module, not an asyncrl.envs.EnvironmentSpec"),
    ("count_env.env:BAD_TASK", "EnvironmentSpec.task='two_args' cannot be called as task(source, task_config, where)"),
    ("count_env.env:BAD_EPISODE", "EnvironmentSpec.episode='Episode' cannot be called as episode(prompt_ids, sample"),
    ("count_env.env", "must be a built-in environment (agent, digits, lookup, math_file, reasoning_gym, textarena) "
                      "or an import path"),
])
def test_a_bad_environment_names_the_key(user_pkg, name, message):
    with open(user_pkg / "env.py", "a") as f:
        f.write(textwrap.dedent("""
            def two_args(source, cfg):
                pass


            class Episode:
                def __init__(self, ids):
                    pass


            BAD_TASK = EnvironmentSpec(task=two_args)
            BAD_EPISODE = EnvironmentSpec(task=make_task, episode=Episode)
            """))
    with pytest.raises(ConfigError) as e:
        import_environments(TaskConfig(sources=[TaskSourceConfig(), TaskSourceConfig(environment=name)]))
    assert str(e.value).startswith(f"task.sources[1].environment={name!r} is invalid") or \
        str(e.value).startswith(f"task.sources[1].environment={name!r}: "), str(e.value)
    assert message in str(e.value), str(e.value)


def test_a_bad_import_path_fails_launch_at_once(tmp_path):
    """It fails after the config is read, before Ray starts. The launch's own work (its CPU time: reading the config,
    which imports jax) is what must stay under 10 s; its wall time on 2 shared cores is that times the load (9.7 s at
    a load average of 10, from 1.9 s of CPU), so the wall bound is only a guard against a start of Ray or a host."""
    t0, cpu0 = time.time(), resource.getrusage(resource.RUSAGE_CHILDREN)
    res = launch(str(tmp_path / "run"), "task.sources=[{environment: 'no_such_pkg.envs:ENVIRONMENT'}]", timeout=60)
    took, cpu1 = time.time() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-3000:]
    assert "task.sources[0].environment='no_such_pkg.envs:ENVIRONMENT' is invalid: cannot import 'no_such_pkg.envs'" \
        in res.stderr, res.stderr[-3000:]
    assert (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime) < 10
    assert took < 30, took  # a local Ray cluster alone takes 5-9 s to start here, hosts far longer
    assert not os.path.exists(tmp_path / "run")  # nothing started: not even the run directory


def test_a_user_environment_trains_on_three_hosts(tmp_path, user_pkg):
    """The README's environment, in a folder outside the repo that only the driver's PYTHONPATH names: the hosts' own
    PYTHONPATH is the repo's (`driver.host_env`), so they import it from the copy Ray's `py_modules` gave them. Every
    logged reward is the user's `score` of its completion."""
    from count_env.env import CountTask

    markers = tmp_path / "markers"
    markers.mkdir()
    run_dir = str(tmp_path / "run")
    source = f"[{{environment: 'count_env.marked:ENVIRONMENT', options: {{marker_dir: '{markers}'}}}}]"
    res = launch(run_dir, *TINY, "train.total_steps=2", "eval.every_n_steps=0", "run.hosts=3",
                 "async.train_workers=1", "logging.rollouts_every_n_steps=1", f"task.sources={source}",
                 env_extra={"PYTHONPATH": str(user_pkg.parent)})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    assert [x["step"] for x in rows(run_dir)] == [1, 2]
    with open(os.path.join(run_dir, "rollouts.jsonl")) as f:
        groups = [g for g in map(json.loads, f) if "completions" in g]
    task = CountTask(eval_size=0)
    by_id = {s.id: s for s, _ in zip(task.samples("train", 0), range(1000))}
    graded = [(task.score(c["text"], by_id[g["id"]]), c) for g in groups for c in g["completions"]]
    assert len(graded) == 2 * 32  # every trained completion of both steps
    assert all((s.reward, s.reason) == (c["reward"], c["reason"]) for s, c in graded)
    assert any(c["reason"] == "no_answer" and c["text"].strip() for _, c in graded)  # digits would say "wrong"
    with open(os.path.join(run_dir, "hosts.json")) as f:
        hosts = json.load(f)
    made = {int(p.stem): p.read_text() for p in markers.iterdir()}
    assert {h["pid"] for h in hosts} <= set(made), (hosts, made)  # every host built the user's task
    for pid in (h["pid"] for h in hosts):  # from Ray's uploaded copy, not from the folder on the driver's path
        assert made[pid].endswith(os.path.join("count_env", "env.py")) and not made[pid].startswith(str(user_pkg))


def test_an_agent_source_is_checked_before_anything_starts(tmp_path, monkeypatch):
    """`environment: agent` needs `agent.fn`; a path that does not import fails naming agent.fn; a good one's
    package is shipped like an environment's."""
    from asyncrl.config.loader import load_config

    source = "task.sources=[{environment: agent, options: {task: digits}}]"
    with pytest.raises(ConfigError, match=r"agent.fn='' is invalid: must be an import path"):
        load_config("default", [source])
    with pytest.raises(ConfigError, match=r"train.moe.router_replay=True is invalid: must be false with an agent"):
        load_config("default", [source, "agent.fn=m:run", "train.moe.router_replay=true"])
    cfg = load_config("default", [source, "agent.fn=no_such_agent.mod:run"])
    with pytest.raises(ConfigError, match=r"agent.fn='no_such_agent.mod:run' cannot be imported"):
        import_environments(cfg.task, cfg.agent.fn)
    pkg = tmp_path / "my_agent"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("def run(base_url, api_key, sample):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert import_environments(cfg.task, "my_agent:run") == [str(pkg)]
    with pytest.raises(ConfigError, match=r"task.sources\[0\].options.task='agent' is invalid"):
        from asyncrl.envs import build_sources

        build_sources(TaskConfig(sources=[TaskSourceConfig(environment="agent", options={"task": "agent"})]))
