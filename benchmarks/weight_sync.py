"""Weight-sync throughput: the cross-host `device_put` hop chain (`HopChainTransfer`) over 2 to 6 processes, store-and-
forward (`bucket_mb=0`) and pipelined (`--bucket-mb`), against a plain loopback TCP socket copy of the same number
of bytes, all measured in the same run.

For each model (tiny and SmolLM2-135M presets, random init, bf16) and each layout (processes x devices each:
2x1, 3x1, 4x1, 6x1, 3x2), the script spawns the processes (CPU backend, gloo collectives, `jax.distributed` on
127.0.0.1, one trainer, the rest receivers in a chain of hops). Rank 0 builds the bf16 tree replicated on
`hc.meshes[0]`; the others receive it from `params_lib.shapes(cfg, bfloat16)`. One warm-up transfer, then
`--repeats` timed ones. The socket baseline: one process `sendall`s a bytes buffer of the model's size over
127.0.0.1, the other `recv_into`s it fully and answers with a 1-byte ack; the sender times send + ack.

Reported per row: the median `weight_sync_s` on the trainer (the whole collective, start barrier to end barrier,
so until the last receiver holds the tree), MB/s (model bytes / that time; 1 MB = 1e6 bytes), ratio = hop-chain
time / socket time, and the time against 2 processes of the same variant. The simulated hosts share this
machine's cores: a chain of N processes does N - 1 transfers' worth of socket copying on them, so the scaling
columns show the machine as much as the chain (benchmarks/README.md discusses it).

    PYTHONPATH=. .venv/bin/python benchmarks/weight_sync.py [--models tiny smollm2-135m] [--repeats 3]
        [--layouts 2x1 3x1 4x1 6x1 3x2] [--bucket-mb 16] [--timeout 600]

Writes benchmarks/results/weight_sync.json. Progress goes to stderr.
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


def worker_hop(rank: int, n: int, port: int, model: str, repeats: int, ndev: int, bucket_mb: float) -> None:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={ndev}"
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
    hc = HopChainTransfer(1, bucket_mb=bucket_mb)
    assert jax.local_device_count() == ndev, jax.local_devices()
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
        c0 = os.times()
        out, t = hc.transfer(tree) if hc.slot == 0 else hc.transfer(None, shapes)
        c1 = os.times()
        t["cpu_s"] = (c1.user - c0.user) + (c1.system - c0.system)  # this process's CPU time in the sync
        timings.append(t)
        log(f"{model} rank {rank} transfer {i}{' (warm-up)' if i == 0 else ''}: "
            f"{t['weight_sync_s']:.3f}s (hops {t['weight_sync_hops_s']:.3f}s)")
    # Sanity: the receiver holds every leaf with the right shape/dtype, one addressable shard each.
    ok = True if out is None else all(o.shape == s.shape and o.dtype == s.dtype and len(o.addressable_shards) == ndev
                                      for o, s in zip(jax.tree.leaves(out), jax.tree.leaves(shapes)))
    # Cheap content check: a checksum of the final norm + first layer leaf, compared across ranks by the parent.
    leaves = jax.tree.leaves(out if out is not None else tree)
    checksum = float(sum(np.asarray(x.addressable_shards[0].data, dtype=np.float64).sum()
                         for x in (leaves[0], leaves[-1])))
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


def socket_baseline(model: str, nbytes: int, repeats: int, timeout: float) -> float:
    log(f"{model}: loopback socket, {nbytes} bytes")
    sport = free_port()
    sock = run_workers([["sock_recv", str(sport), str(nbytes), str(repeats)],
                        ["sock_send", str(sport), str(nbytes), str(repeats)]], timeout, f"{model} socket")
    recv = next(r for r in sock if r["kind"] == "sock_recv")
    send = next(r for r in sock if r["kind"] == "sock_send")
    assert recv["ok"] and recv["head"] == send["head"] and recv["tail"] == send["tail"], (recv, send)
    return statistics.median(send["send_s"][1:])


def bench_chain(model: str, n: int, ndev: int, bucket_mb: float, repeats: int, timeout: float) -> dict:
    log(f"{model}: hop chain, {n} processes x {ndev} devices, bucket_mb={bucket_mb:g}")
    port = free_port()
    hop = run_workers([["hop", str(r), str(n), str(port), model, str(repeats), str(ndev), str(bucket_mb)]
                       for r in range(n)], timeout, f"{model} hop chain {n}x{ndev}")
    hop = sorted(hop, key=lambda r: r["rank"])
    assert len(hop) == n and all(r["ok"] for r in hop), hop
    assert len({r["checksum"] for r in hop}) == 1, ("a receiver's checksum differs", hop)
    med = lambda rank, key: statistics.median(t[key] for t in hop[rank]["timings"][1:])  # noqa: E731
    return {"model": model, "processes": n, "devices_per_process": ndev, "bucket_mb": bucket_mb,
            "bytes": int(hop[0]["timings"][0]["weight_sync_bytes"]), "leaves": hop[0]["leaves"],
            "buckets": int(hop[0]["timings"][0]["weight_sync_buckets"]),
            "seconds": med(0, "weight_sync_s"), "last_receiver_hops_s": med(n - 1, "weight_sync_hops_s"),
            # CPU seconds of all processes together per sync: on a machine of C cores no sync can take less than
            # cpu_s / C, however well the hops overlap.
            "cpu_s": statistics.median(sum(r["timings"][k]["cpu_s"] for r in hop) for k in range(1, repeats + 1)),
            "timings": {f"rank{r['rank']}": r["timings"] for r in hop}}  # [0] is the warm-up


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        kind, args = sys.argv[2], sys.argv[3:]
        if kind == "hop":
            rank, n, port, model, repeats = int(args[0]), int(args[1]), int(args[2]), args[3], int(args[4])
            worker_hop(rank, n, port, model, repeats, int(args[5]), float(args[6]))
        elif kind == "sock_recv":
            worker_sock_recv(int(args[0]), int(args[1]), int(args[2]))
        elif kind == "sock_send":
            worker_sock_send(int(args[0]), int(args[1]), int(args[2]))
        else:
            raise SystemExit(f"unknown worker {kind}")
        return

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["tiny", "smollm2-135m"])
    ap.add_argument("--layouts", nargs="+", default=["2x1", "3x1", "4x1", "6x1", "3x2"],
                    help="processes x devices per process")
    ap.add_argument("--bucket-mb", type=float, default=16.0, help="the pipelined variant's weightsync.bucket_mb")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per group of worker processes")
    a = ap.parse_args()
    load0 = os.getloadavg()
    layouts = [tuple(int(x) for x in lay.split("x")) for lay in a.layouts]
    variants = [("store-and-forward", 0.0), ("pipelined", a.bucket_mb)]
    rows = []
    for model in a.models:
        for n, ndev in layouts:
            for name, mb in variants:
                rows.append({"variant": name, **bench_chain(model, n, ndev, mb, a.repeats, a.timeout)})
        sock_s = socket_baseline(model, rows[-1]["bytes"], a.repeats, a.timeout)
        for r in rows:
            if r["model"] == model:
                base = next(b for b in rows if b["model"] == model and b["variant"] == r["variant"]
                            and (b["processes"], b["devices_per_process"]) == (2, 1))
                r |= {"MBps": r["bytes"] / r["seconds"] / 1e6, "socket_s": sock_s,
                      "socket_MBps": r["bytes"] / sock_s / 1e6, "ratio_to_socket": r["seconds"] / sock_s,
                      "vs_2_processes": r["seconds"] / base["seconds"]}

    hdr = (f"{'model':<14}{'layout':>7}{'variant':>19}{'buckets':>8}{'seconds':>9}{'MB/s':>8}{'socket s':>10}"
           f"{'x socket':>9}{'vs 2 procs':>11}{'CPU s':>8}{'CPU s/cores':>12}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['model']:<14}{str(r['processes']) + 'x' + str(r['devices_per_process']):>7}{r['variant']:>19}"
              f"{r['buckets']:>8}{r['seconds']:>9.4f}{r['MBps']:>8.0f}{r['socket_s']:>10.4f}"
              f"{r['ratio_to_socket']:>8.2f}x{r['vs_2_processes']:>10.2f}x{r['cpu_s']:>8.3f}"
              f"{r['cpu_s'] / os.cpu_count():>12.3f}")
    load1 = os.getloadavg()
    print(f"\nseconds = median weight_sync_s on the trainer (start barrier to end barrier: until the last receiver "
          f"holds the tree); x socket = seconds / loopback socket seconds for the same bytes; vs 2 procs = seconds / "
          f"the same variant's 2x1 seconds; CPU s = CPU time of all "
          f"processes per sync (CPU s/cores: the least time any schedule of it can take here). "
          f"Load average {load0[0]:.2f} at start, {load1[0]:.2f} at end, "
          f"{os.cpu_count()} CPUs.")
    out = {"setup": {"models": a.models, "layouts": a.layouts, "bucket_mb": a.bucket_mb, "repeats": a.repeats,
                     "backend": "cpu (gloo collectives, cross-host transfer socket)", "dtype": "bfloat16",
                     "cpus": os.cpu_count(), "loadavg_start": load0, "loadavg_end": load1,
                     "python": platform.python_version()},
           "results": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "weight_sync.json").write_text(json.dumps(out, indent=2) + "\n")
    log(f"wrote {RESULTS / 'weight_sync.json'}")


if __name__ == "__main__":
    main()
