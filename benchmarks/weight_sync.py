"""Weight-sync throughput: the cross-host `device_put` hop chain (`HopChainTransfer`) against a plain loopback
TCP socket copy of the same number of bytes, measured in the same run.

For each model (tiny and SmolLM2-135M presets, random init, bf16) the script spawns:
  * 2 hop-chain processes (one device each, CPU backend, gloo collectives, `jax.distributed` on 127.0.0.1):
    rank 0 is the trainer (slot 0) and builds the bf16 tree replicated on `hc.meshes[0]`; rank 1 receives it
    from `params_lib.shapes(cfg, bfloat16)`. One warm-up transfer, then `--repeats` timed ones.
  * 2 socket processes: one `sendall`s a bytes buffer of the same total size over 127.0.0.1, the other
    `recv_into`s it fully and answers with a 1-byte ack. The sender times send + ack. Same warm-up and repeats.

Reported per model: the median `weight_sync_s` (whole collective incl. its start/end barriers, as the trainer
sees it) and the receiver's `weight_sync_hops_s` (from the start barrier until it holds the tree; the
trainer's own hops_s only covers its asynchronous enqueue) of the timed transfers, the median socket copy time, MB/s
(1 MB = 1e6 bytes) for both, and ratio = socket MB/s / hop-chain MB/s (how many times faster the raw socket is).
The machine is shared (2 cores): only ratios within one run mean much.

    PYTHONPATH=. .venv/bin/python benchmarks/weight_sync.py [--models tiny smollm2-135m] [--repeats 3]
        [--timeout 600]

Writes benchmarks/results/weight_sync.json. Progress goes to stderr. Each process has one device (the simplest
hop; multi-device hosts are covered by tests/test_weight_sync.py).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import socket
import statistics
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[weight_sync {time.perf_counter() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def emit(obj: dict) -> None:
    print("RESULT " + json.dumps(obj), flush=True)


# ----------------------------------------------------------------------------------------------- workers


def worker_hop(rank: int, n: int, port: int, model: str, repeats: int) -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, str(ROOT))
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    from asyncrl.weightsync.transfer import HopChainTransfer, enable_cpu_transfers

    enable_cpu_transfers()
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=n, process_id=rank)
    from asyncrl.models import params as params_lib, preset

    cfg = preset(model)
    hc = HopChainTransfer(1)
    assert jax.local_device_count() == 1, jax.local_devices()
    shapes = params_lib.shapes(cfg, jnp.bfloat16)
    init = lambda k: params_lib.cast(params_lib.init_params(cfg, k, jnp.float32), jnp.bfloat16)  # noqa: E731
    tree = None
    if hc.slot == 0:
        rep = jax.tree.map(lambda _: NamedSharding(hc.meshes[0], P()), shapes)
        t = time.perf_counter()
        tree = jax.block_until_ready(jax.jit(init, out_shardings=rep)(jax.random.PRNGKey(0)))
        log(f"{model} rank {rank}: built trainer tree in {time.perf_counter() - t:.1f}s")
    timings = []
    for i in range(repeats + 1):  # first one is the warm-up (compiles/sets up the hops)
        out, t = hc.transfer(tree) if hc.slot == 0 else hc.transfer(None, shapes)
        timings.append(t)
        log(f"{model} rank {rank} transfer {i}{' (warm-up)' if i == 0 else ''}: "
            f"{t['weight_sync_s']:.3f}s (hops {t['weight_sync_hops_s']:.3f}s)")
    # Sanity: the receiver holds every leaf with the right shape/dtype, one addressable shard each.
    ok = all(o.shape == s.shape and o.dtype == s.dtype and len(o.addressable_shards) == 1
             for o, s in zip(jax.tree.leaves(out), jax.tree.leaves(shapes)))
    # Cheap content check: a checksum of the final norm + first layer leaf, compared across ranks by the parent.
    leaves = jax.tree.leaves(out)
    checksum = float(sum(np.asarray(jax.device_get(x), dtype=np.float64).sum() for x in (leaves[0], leaves[-1])))
    emit({"kind": "hop", "rank": rank, "slot": hc.slot, "ok": bool(ok), "leaves": len(leaves),
          "checksum": checksum, "timings": timings})


def _recv_exact(conn: socket.socket, view: memoryview) -> int:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            raise ConnectionError(f"peer closed after {got} of {len(view)} bytes")
        got += n
    return got


def worker_sock_recv(port: int, nbytes: int, repeats: int) -> None:
    buf = bytearray(nbytes)
    view = memoryview(buf)
    with socket.socket() as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", port))
        srv.listen(1)
        srv.settimeout(120)
        conn, _ = srv.accept()
        with conn:
            conn.settimeout(300)
            times = []
            for _ in range(repeats + 1):
                t = time.perf_counter()
                got = _recv_exact(conn, view)
                times.append(time.perf_counter() - t)
                conn.sendall(b"k")
    emit({"kind": "sock_recv", "ok": got == nbytes, "bytes": got, "head": bytes(buf[:8]).hex(),
          "tail": bytes(buf[-8:]).hex(), "recv_s": times})


def worker_sock_send(port: int, nbytes: int, repeats: int) -> None:
    import numpy as np

    payload = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8).tobytes()  # a plain bytes buffer
    deadline = time.time() + 120
    while True:
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            break
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.1)
    with sock:
        sock.settimeout(300)
        times = []
        for _ in range(repeats + 1):  # first one is the warm-up
            t = time.perf_counter()
            sock.sendall(payload)
            if sock.recv(1) != b"k":
                raise ConnectionError("no ack")
            times.append(time.perf_counter() - t)
    emit({"kind": "sock_send", "bytes": nbytes, "head": payload[:8].hex(), "tail": payload[-8:].hex(),
          "send_s": times})


# ----------------------------------------------------------------------------------------------- driver


def run_workers(argvs: list[list[str]], timeout: float, label: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    procs = [subprocess.Popen([sys.executable, str(pathlib.Path(__file__).resolve()), "--worker", *a],
                              stdout=subprocess.PIPE, stderr=None, text=True, env=env, cwd=str(ROOT))
             for a in argvs]
    outs: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outs.append(out)
            if p.returncode != 0:
                raise RuntimeError(f"{label}: worker {p.args[3:]} exited {p.returncode}:\n{out[-3000:]}")
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"{label}: workers did not finish within {timeout:.0f}s") from e
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
    return [json.loads(line[len("RESULT "):]) for o in outs for line in o.splitlines() if line.startswith("RESULT ")]


def bench_model(model: str, repeats: int, timeout: float) -> dict:
    log(f"{model}: hop chain, 2 processes x 1 device")
    port = free_port()
    hop = run_workers([["hop", str(r), "2", str(port), model, str(repeats)] for r in range(2)], timeout,
                      f"{model} hop chain")
    hop = sorted(hop, key=lambda r: r["rank"])
    assert len(hop) == 2 and all(r["ok"] for r in hop), hop
    assert hop[0]["checksum"] == hop[1]["checksum"], ("receiver checksum differs", hop)
    nbytes = int(hop[0]["timings"][0]["weight_sync_bytes"])

    log(f"{model}: loopback socket, {nbytes} bytes")
    sport = free_port()
    sock = run_workers([["sock_recv", str(sport), str(nbytes), str(repeats)],
                        ["sock_send", str(sport), str(nbytes), str(repeats)]], timeout, f"{model} socket")
    recv = next(r for r in sock if r["kind"] == "sock_recv")
    send = next(r for r in sock if r["kind"] == "sock_send")
    assert recv["ok"] and recv["head"] == send["head"] and recv["tail"] == send["tail"], (recv, send)

    def med(rank: int, key: str) -> float:
        return statistics.median(t[key] for t in hop[rank]["timings"][1:])

    hop_s = med(0, "weight_sync_s")  # the trainer's view of the whole collective (ends with a barrier)
    hops_s = med(0, "weight_sync_hops_s")
    recv_hops_s = med(1, "weight_sync_hops_s")  # receiver: from the start barrier to holding the tree
    sock_s = statistics.median(send["send_s"][1:])
    mbs = lambda s: nbytes / s / 1e6  # noqa: E731
    return {
        "model": model, "bytes": nbytes, "leaves": hop[0]["leaves"], "repeats": repeats,
        "hop_chain_s": hop_s, "hop_chain_MBps": mbs(hop_s),
        "hop_chain_hops_s": hops_s, "hop_chain_hops_MBps": mbs(hops_s),
        "receiver_hops_s": recv_hops_s, "receiver_hops_MBps": mbs(recv_hops_s),
        "socket_s": sock_s, "socket_MBps": mbs(sock_s),
        "ratio_socket_over_hop_chain": hop_s / sock_s,
        "hop_chain_timings": {f"rank{r['rank']}": r["timings"] for r in hop},  # [0] is the warm-up
        "socket_send_s": send["send_s"], "socket_recv_s": recv["recv_s"],  # [0] is the warm-up
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        kind, args = sys.argv[2], sys.argv[3:]
        if kind == "hop":
            rank, n, port, model, repeats = int(args[0]), int(args[1]), int(args[2]), args[3], int(args[4])
            worker_hop(rank, n, port, model, repeats)
        elif kind == "sock_recv":
            worker_sock_recv(int(args[0]), int(args[1]), int(args[2]))
        elif kind == "sock_send":
            worker_sock_send(int(args[0]), int(args[1]), int(args[2]))
        else:
            raise SystemExit(f"unknown worker {kind}")
        return

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["tiny", "smollm2-135m"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per group of worker processes")
    a = ap.parse_args()

    rows = [bench_model(m, a.repeats, a.timeout) for m in a.models]

    hdr = (f"{'model':<14}{'bytes':>12}{'hop-chain s':>13}{'hop MB/s':>11}{'hops-only s':>13}"
           f"{'socket s':>10}{'socket MB/s':>13}{'ratio':>8}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['model']:<14}{r['bytes']:>12}{r['hop_chain_s']:>13.4f}{r['hop_chain_MBps']:>11.1f}"
              f"{r['receiver_hops_s']:>13.4f}{r['socket_s']:>10.4f}{r['socket_MBps']:>13.1f}"
              f"{r['ratio_socket_over_hop_chain']:>7.2f}x")
    print("\nhop-chain s = median weight_sync_s on the trainer (incl. start/end barriers); hops-only s = median "
          "weight_sync_hops_s on the receiver (the trainer's own is only its async enqueue); ratio = socket MB/s / hop-chain MB/s. Timing dicts (warm-up first) in the JSON.")
    for r in rows:
        for rank, ts in r["hop_chain_timings"].items():
            last = {k: round(v, 4) for k, v in ts[-1].items()}
            print(f"  {r['model']} {rank} last transfer: {last}")

    try:
        load = os.getloadavg()
    except OSError:
        load = None
    out = {"setup": {"models": a.models, "repeats": a.repeats, "processes": 2, "devices_per_process": 1,
                     "backend": "cpu (gloo collectives, cross-host transfer socket)", "dtype": "bfloat16",
                     "cpus": os.cpu_count(), "loadavg_end": load, "python": platform.python_version()},
           "results": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "weight_sync.json").write_text(json.dumps(out, indent=2) + "\n")
    log(f"wrote {RESULTS / 'weight_sync.json'}")


if __name__ == "__main__":
    main()
