"""Weight sync over the cross-host device_put hop chain: receivers get the trainer's cast params bit for bit."""

import os
import socket
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(n: int, tw: int, ndev: int = 2) -> list[str]:
    port = _port()
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "weightsync_worker.py"), str(r), str(n), str(port),
                               str(tw), str(ndev)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for r in range(n)]
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=int(os.environ.get("WS_TIMEOUT", "240")))
            outs.append(out)
            assert p.returncode == 0, out[-3000:]
    finally:
        for p in procs:
            p.kill()
    return [line for o in outs for line in o.splitlines() if line.startswith("RESULT")]


@pytest.mark.slow
@pytest.mark.parametrize("n,tw,ndev", [(3, 1, 1), (4, 2, 1), (4, 1, 1), (3, 1, 2), (4, 2, 2)])
def test_hop_chain_bit_exact(n, tw, ndev):
    results = _run(n, tw, ndev)
    assert len(results) == 2 * n, results
    assert all("ok=True" in r for r in results), results
    # every slot took part: slot 0 (trainers) and slots 1.. (receivers)
    assert {r.split()[2] for r in results} == {f"slot={s}" for s in range(n // tw)}


@pytest.mark.parametrize("ndev", [1, 2])
def test_hop_chain_two_processes_quick(ndev):
    """ndev=2: every slot is a 2-device mesh, so each replicated leaf moves as 2 shards per hop."""
    results = _run(2, 1, ndev=ndev)
    assert len(results) == 4 and all("ok=True" in r for r in results), results
