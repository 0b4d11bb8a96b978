"""`run.dashboard=true` on a local run: the embedded Ray cluster serves its dashboard and the Prometheus metrics
endpoint, the `asyncrl_*` gauges show live values there while the run goes, and the simulated hosts' own sockets
(the JAX coordinator, the CPU transfer sockets) listen on 127.0.0.1 only."""

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import psutil
import pytest

from tests.helpers import launch_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["train.format_warmstart_steps=0", "inference.max_seq_len=24", "inference.max_decode_batch_size=8",
        "inference.max_prefill_prompts=4", "train.train_batch_size=32", "inference.group_size=4",
        "eval.num_prompts=8", "eval.group_size=2", "eval.every_n_steps=10", "checkpoint.every_n_steps=0",
        "checkpoint.resume=false", "logging.tensorboard=false", "logging.ray_metrics=true"]
LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}  # a v6 socket may show an IPv4 loopback as mapped
GAUGE = re.compile(r"^(?:ray_)?(asyncrl_\w+)\{([^}]*)\}\s+(\S+)$", re.M)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except OSError:
        return 0, ""


def _gauges(text: str, run: str) -> dict[str, float]:
    return {name: float(value) for name, tags, value in GAUGE.findall(text) if f'run="{run}"' in tags}


def _listening(pid: int) -> list[str]:
    try:
        conns = psutil.Process(pid).net_connections(kind="inet")
    except psutil.NoSuchProcess:
        return []
    return [(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]


@pytest.mark.slow
def test_local_dashboard_serves_live_asyncrl_gauges_on_loopback(tmp_path):
    metrics_port, dash_port, run = _free_port(), _free_port(), "dash-test"
    run_dir = tmp_path / "run"
    env = launch_env()
    env["RAY_metrics_report_interval_ms"] = "1000"  # Ray's push interval from workers to the metrics agent
    cmd = [sys.executable, "launch.py", f"run.run_dir={run_dir}", f"run.name={run}", "train.total_steps=400", *TINY,
           "run.dashboard=true", f"run.dashboard_port={dash_port}", f"run.metrics_export_port={metrics_port}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)
    reader.start()
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    seen: list[dict[str, float]] = []
    listening: dict[int, list[tuple[str, int]]] = {}
    try:
        deadline = time.time() + 600
        while time.time() < deadline and proc.poll() is None:
            time.sleep(2)
            g = _gauges(_get(url)[1], run)
            if "asyncrl_weight_version" in g and (not seen or g["asyncrl_weight_version"] > seen[-1].get(
                    "asyncrl_weight_version", -1)):
                seen.append(g)
            if not listening and os.path.exists(run_dir / "hosts.json") and seen:
                hosts = json.loads((run_dir / "hosts.json").read_text())
                listening = {h["pid"]: _listening(h["pid"]) for h in hosts}
                assert _get(f"http://127.0.0.1:{dash_port}/")[0] == 200  # the dashboard itself
            if len(seen) >= 3 and listening:
                break
        text = "".join(out)
        assert len(seen) >= 3, f"asyncrl gauges never showed up at {url}; output:\n{text[-4000:]}"
    finally:
        proc.send_signal(signal.SIGINT)  # KeyboardInterrupt: the driver tears its own cluster down (finally)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    text = "".join(out)
    assert f"Ray dashboard: http://127.0.0.1:{dash_port}" in text, text[-3000:]
    assert f"Prometheus metrics: http://127.0.0.1:{metrics_port}/metrics" in text
    # Live: the weight version (= steps done) rises between scrapes, and the step's metrics are real numbers.
    versions = [g["asyncrl_weight_version"] for g in seen]
    assert versions == sorted(versions) and versions[-1] > versions[0] >= 1
    last = seen[-1]
    for name in ("asyncrl_train_loss", "asyncrl_rollout_reward_mean", "asyncrl_train_tokens_per_s"):
        assert name in last and math.isfinite(last[name]), sorted(last)
    assert 0.0 <= last["asyncrl_rollout_reward_mean"] <= 1.0 and last["asyncrl_train_tokens_per_s"] > 0
    # Loopback only: the JAX coordinator and the CPU transfer sockets that hosts.json names, checked against the
    # sockets the host processes really listen on.
    hosts = json.loads((run_dir / "hosts.json").read_text())
    named = [(h["pid"], addr) for h in hosts for addr in h["listen"].values()]
    assert len(named) == len(hosts) + 1 and all(a.startswith("127.0.0.1:") for _, a in named), hosts
    for pid, addr in named:
        port = int(addr.rsplit(":", 1)[1])
        ips = [ip for ip, p in listening[pid] if p == port]
        assert ips and set(ips) <= LOOPBACK, (addr, listening[pid])
