"""`launch.py submit|status|logs|stop`: the run as a Ray Job on a running cluster (`ray up` or `ray start`).

Ray 2.60 keeps token authentication on: clients send the token from ~/.ray/auth_token only when
RAY_AUTH_MODE=token is in their environment, so we set it when the token file exists.
"""

from __future__ import annotations

import os
import shlex
import sys
import time
from collections.abc import Sequence

EXCLUDES = [".venv", ".git", "runs", "benchmarks/results", "__pycache__", "*.pyc", ".pytest_cache"]
# A head just started with `ray start` refuses jobs with this until its dashboard agent registers (tens of seconds
# under load): a submission then waits, up to `agent_wait_s`, instead of failing.
NO_AGENT = "No available agent to submit job"
AGENT_WAIT_S = 120.0
AGENT_POLL_S = 2.0


def _address(address: str | None) -> str:
    addr = address or os.environ.get("RAY_ADDRESS")
    if not addr:
        raise SystemExit("error: no cluster address: pass --address http://HEAD:8265 or set RAY_ADDRESS")
    if addr.startswith("ray://"):
        raise SystemExit("error: --address must be the dashboard/Jobs address (http://HEAD:8265), not ray://")
    return addr if "://" in addr else f"http://{addr}"


def _client(address: str | None):
    if os.path.isfile(os.path.expanduser("~/.ray/auth_token")):
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(_address(address))


def submit_when_ready(client, wait_s: float = AGENT_WAIT_S, **job) -> str:
    """`client.submit_job(**job)`, retried while the head answers NO_AGENT, for up to `wait_s` seconds; then a
    SystemExit that says what was waited for. Any other error is raised at once."""
    deadline = time.monotonic() + wait_s
    waiting = False
    while True:
        try:
            return client.submit_job(**job)
        except RuntimeError as e:
            if NO_AGENT not in str(e):
                raise
            left = deadline - time.monotonic()
            if left <= 0:
                raise SystemExit(f"error: the head still answers '{NO_AGENT}' after {wait_s:g}s: its dashboard "
                                 "agent has not started (check the head's dashboard_agent logs), or pass a "
                                 "longer --agent-wait-s") from e
            if not waiting:
                print(f"the head has no job agent yet (just started?): waiting up to {wait_s:g}s", file=sys.stderr)
                waiting = True
            time.sleep(min(AGENT_POLL_S, left))


def submit(address: str | None, launch_args: Sequence[str], python: str | None = None, wait: bool = False,
           agent_wait_s: float = AGENT_WAIT_S, py_modules: Sequence[str] = ()) -> int:
    """Submit the run as a Ray Job: the repo as its working_dir, and `py_modules` (the user's environment packages,
    `plugins.py`) beside it, so the driver on the head imports them and ships them on to the hosts."""
    client = _client(address)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    addr = _address(address)
    local = any(h in addr for h in ("127.0.0.1", "localhost"))
    py = python or (sys.executable if local else "python")
    entry = " ".join([shlex.quote(py), "launch.py", *map(shlex.quote, launch_args)])
    runtime_env = {"working_dir": root, "excludes": EXCLUDES}
    if py_modules:
        runtime_env["py_modules"] = list(py_modules)
    job_id = submit_when_ready(client, agent_wait_s, entrypoint=entry, runtime_env=runtime_env)
    print(f"submitted job {job_id}")
    print(f"dashboard: {addr.rstrip('/')}/#/jobs/{job_id}")
    print(f"follow:    python launch.py logs {job_id}   |   status: python launch.py status {job_id}")
    if wait:
        return wait_for(address, job_id)
    return 0


def wait_for(address: str | None, job_id: str, timeout_s: float = 3600) -> int:
    client = _client(address)
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        status = str(client.get_job_status(job_id))
        if status.endswith(("SUCCEEDED", "FAILED", "STOPPED")):
            print(status)
            return 0 if status.endswith("SUCCEEDED") else 1
        time.sleep(2)
    print(f"job {job_id} still running after {timeout_s:.0f}s", file=sys.stderr)
    return 1


def status(address: str | None, job_id: str) -> int:
    info = _client(address).get_job_info(job_id)
    print(f"{job_id}: {info.status}" + (f" ({info.message})" if info.message else ""))
    return 0


def logs(address: str | None, job_id: str) -> int:
    print(_client(address).get_job_logs(job_id), end="")
    return 0


def stop(address: str | None, job_id: str) -> int:
    print("stopped" if _client(address).stop_job(job_id) else "not running")
    return 0
