"""`launch.py submit` (`asyncrl/orchestration/submit.py`) to a head that has just started: Ray answers "No
available agent to submit job" until the head's dashboard agent is up, and the submission waits for it, bounded. The
user's environment package travels with the job."""

import sys
import time

import pytest

from asyncrl.orchestration import submit as jobs

# What Ray 2.60's JobSubmissionClient raises for the head's 503 (dashboard_sdk._raise_error).
NO_AGENT_ERROR = RuntimeError("Request failed with status code 503: No available agent to submit job, please try "
                              "again later..")


class FakeClient:
    """A JobSubmissionClient whose head has no agent for its first `refusals` submissions."""

    def __init__(self, refusals: float, error: Exception = NO_AGENT_ERROR) -> None:
        self.refusals, self.error, self.calls = refusals, error, []

    def submit_job(self, **job):
        self.calls.append(job)
        if len(self.calls) <= self.refusals:
            raise self.error
        return "raysubmit_fake"


@pytest.fixture
def fake(monkeypatch):
    def install(client: FakeClient) -> FakeClient:
        monkeypatch.setattr(jobs, "_client", lambda address: client)
        monkeypatch.setattr(jobs, "AGENT_POLL_S", 0.01)
        return client
    return install


def test_submit_waits_for_the_agent_then_submits(fake, capsys):
    client = fake(FakeClient(refusals=2))
    assert jobs.submit("http://127.0.0.1:8265", ["train.max_steps=1"], agent_wait_s=30) == 0
    assert len(client.calls) == 3 and "launch.py train.max_steps=1" in client.calls[-1]["entrypoint"]
    out, err = capsys.readouterr()
    assert "submitted job raysubmit_fake" in out
    assert err.count("the head has no job agent yet") == 1  # said once, not per retry


def test_submit_gives_up_after_the_bound_with_a_clear_message(fake):
    client = fake(FakeClient(refusals=float("inf")))
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as e:
        jobs.submit("http://127.0.0.1:8265", [], agent_wait_s=0.3)
    assert time.monotonic() - t0 < 5
    assert "No available agent to submit job" in str(e.value) and "after 0.3s" in str(e.value)
    assert "--agent-wait-s" in str(e.value) and len(client.calls) >= 2


def test_other_errors_are_not_retried(fake):
    client = fake(FakeClient(refusals=1, error=RuntimeError("Request failed with status code 400: bad runtime_env")))
    with pytest.raises(RuntimeError, match="bad runtime_env"):
        jobs.submit("http://127.0.0.1:8265", [], agent_wait_s=30)
    assert len(client.calls) == 1


def test_the_cli_passes_the_bound_and_checks_it(fake, capsys):
    from asyncrl.cli import jobs as cli

    client = fake(FakeClient(refusals=float("inf")))
    with pytest.raises(SystemExit, match="after 0.2s"):
        cli.main("submit", ["--address", "http://127.0.0.1:8265", "--agent-wait-s", "0.2"])
    assert client.calls
    assert cli.main("submit", ["--address", "http://127.0.0.1:8265", "--agent-wait-s", "-1"]) == 2
    assert "--agent-wait-s must be >= 0" in capsys.readouterr().err


def test_submit_sends_the_users_environment_package_with_the_job(fake, tmp_path, monkeypatch, capsys):
    """`launch.py submit` imports the run's environments first (a bad one is a config error, nothing submitted) and
    sends the package that holds the user's one with the job (`py_modules`), beside the repo (`working_dir`)."""
    from asyncrl.cli import jobs as cli

    pkg = tmp_path / "my_env"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from asyncrl.envs.digits import ENVIRONMENT  # noqa: F401\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    client = fake(FakeClient(refusals=0))
    addr = ["--address", "http://127.0.0.1:8265"]
    assert cli.main("submit", addr + ["task.sources=[{environment: 'my_env:ENVIRONMENT'}]"]) == 0
    env = client.calls[-1]["runtime_env"]
    assert env["py_modules"] == [str(pkg)] and env["working_dir"] and ".git" in env["excludes"]
    assert cli.main("submit", addr) == 0 and "py_modules" not in client.calls[-1]["runtime_env"]  # built-ins only
    assert cli.main("submit", addr + ["task.sources=[{environment: 'my_env:NOPE'}]"]) == 2 and len(client.calls) == 2
    assert "task.sources[0].environment='my_env:NOPE' is invalid: 'my_env' has no attribute 'NOPE'" in \
        capsys.readouterr().err
    del sys.modules["my_env"]
