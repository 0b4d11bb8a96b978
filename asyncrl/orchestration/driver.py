"""The Ray driver: connect, place one host actor per host, join them with jax.distributed, watch, restart.

Locally (no RAY_ADDRESS) it starts its own Ray cluster and simulates `run.hosts` hosts, each a process with
`run.devices_per_host` fake CPU devices. Their JAX coordinator and CPU transfer sockets bind to 127.0.0.1, and
with `run.dashboard` so does the dashboard. (Ray's own services keep Ray's node IP: on Linux Ray turns a loopback
node address back into the machine's, and they sit behind Ray's token auth.) On a TPU cluster it finds the TPU
hosts and places one actor on each with a STRICT_SPREAD placement group; they bind to their node's IP. With
`run.platform: gpu` each of `run.hosts` actors takes `run.devices_per_host` GPUs (`gpu_host_options`).

It reads the driver's part of the run config (`DriverConfig`) and hands each host actor its `HostConfig`.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import sys
import time
from typing import Any

import ray

from asyncrl.orchestration import evals, jsonl, logs, plugins, rollout_log
from asyncrl.orchestration.failures import HostFailure, failure_of, report_late_failures, root_cause
from asyncrl.orchestration.host import HostActor, role_of
from asyncrl.orchestration.metrics import MetricsSink
from asyncrl.orchestration.progress import Progress
from asyncrl.orchestration.queues import make_queues
from asyncrl.orchestration.role_config import DriverConfig

log = logging.getLogger("asyncrl.driver")


class RunStalled(RuntimeError):
    """No step was published for run.stall_timeout_s; every host's stacks were dumped."""


def run_dir_of(cfg: DriverConfig) -> str:
    return os.path.abspath(cfg.run.run_dir or os.path.join("runs", cfg.run.name))


def latest_checkpoint(run_dir: str) -> int | None:
    d = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(d):
        return None
    steps = [int(x) for x in os.listdir(d) if x.isdigit()]
    return max(steps) if steps else None


LOOPBACK = "127.0.0.1"


def _connect(cfg: DriverConfig, py_modules: list[str]) -> bool:
    """Returns True if this driver started the cluster (and so must shut it down). `py_modules`: the user's
    environment packages (`plugins.py`), given to the job's runtime_env: Ray uploads local folders only at the job
    level, and every host actor inherits them from it (on its path, beside its own env_vars)."""
    if ray.is_initialized():
        return False
    ship = {"py_modules": py_modules} if py_modules else {}
    address = os.environ.get("RAY_ADDRESS")
    if address:
        # Under `launch.py submit` the job's own runtime_env already carries them (`submit.py`); naming them again
        # would be a conflict Ray refuses.
        in_job = plugins.RAY_JOB_CONFIG in os.environ
        ray.init(address=address, logging_level=logging.WARNING, runtime_env=None if in_job else ship or None)
        return False
    extra: dict[str, Any] = {}
    if cfg.run.dashboard:
        extra = {"dashboard_host": LOOPBACK, "dashboard_port": cfg.run.dashboard_port}
        if cfg.run.metrics_export_port is not None:
            extra["_metrics_export_port"] = cfg.run.metrics_export_port
    # Ray prestarts an idle Python worker per CPU, which no actor of a run uses (the hosts and the queue hub start
    # their own): 2 idle workers, ~2 of the 53 CPU-s of a 3-step two-host run (2026-12-07). The raylet reads these
    # from the environment it inherits; a value the user set wins.
    for var in ("RAY_enable_worker_prestart", "RAY_prestart_worker_first_driver"):
        os.environ.setdefault(var, "0")
    # address="local": always a new cluster of our own, never one that `ray start` left running on this machine.
    ctx = ray.init(address="local", num_cpus=max(2, os.cpu_count() or 2), include_dashboard=cfg.run.dashboard,
                   logging_level=logging.WARNING,
                   runtime_env={"env_vars": {"PYTHONPATH": _project_root()}, **ship}, **extra)
    if cfg.run.dashboard:
        port = next((n.get("MetricsExportPort") for n in ray.nodes() if n.get("Alive")), None)
        if not ctx.dashboard_url:  # e.g. the port is taken; the run itself does not need it
            log.warning("run.dashboard: Ray did not start its dashboard on port %d", cfg.run.dashboard_port)
        else:
            print(f"[asyncrl] Ray dashboard: http://{ctx.dashboard_url}   Prometheus metrics: "
                  f"http://{LOOPBACK}:{port}/metrics", file=sys.stderr, flush=True)
    return True


def _project_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tpu_hosts() -> list[dict[str, Any]]:
    return [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("TPU", 0) > 0]


def host_env() -> dict[str, str]:
    """The environment of every host actor."""
    # Hosts use transformers for tokenizers only: its advice that PyTorch is missing (one line per host, on a
    # machine without torch) asks nothing of the user. Its warnings and errors still print.
    env = {"PYTHONPATH": _project_root(), "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}
    for var in ("ASYNCRL_STACK_DUMP_S", "ASYNCRL_FAULTS"):  # debugging and fault injection (faults.py)
        if os.environ.get(var):
            env[var] = os.environ[var]
    return env


def gpu_host_options(cfg: DriverConfig, env: dict[str, str]) -> dict[str, Any]:
    """Ray options of one host actor of a `run.platform: gpu` run: `run.devices_per_host` GPUs each (Ray sets the
    actor's CUDA_VISIBLE_DEVICES to them), on JAX's CUDA backend; the hosts join one jax.distributed job, whose
    collectives and cross-host transfers are the GPU backend's own (no gloo, no CPU transfer sockets)."""
    return {"num_cpus": 1, "num_gpus": cfg.run.devices_per_host, "max_restarts": 0, "max_concurrency": 2,
            "runtime_env": {"env_vars": env | {"JAX_PLATFORMS": "cuda"}}}


def cpu_host_env(cfg: DriverConfig) -> dict[str, str]:
    """What a simulated CPU host adds to `host_env()`: the CPU backend with `run.devices_per_host` fake devices.

    With several trainer hosts, a user's persistent JAX compilation cache (JAX_COMPILATION_CACHE_DIR) is switched off
    for the hosts: the second trainer loads the programs the first one wrote, and after a restart the two ran
    mismatched gloo collectives (trainer 1 aborted on "Received data size doesn't match expected size. 64 vs 4";
    reproduced twice with two trainers, the KL term and a kill in a weight sync, 2026-12-07; cause not found). With
    one trainer no collective spans two processes, and the cache is kept."""
    env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={cfg.run.devices_per_host}",
           "OMP_NUM_THREADS": "1"}
    if cfg.async_.train_workers > 1 and os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        log.warning("JAX_COMPILATION_CACHE_DIR is ignored by the hosts of a CPU run with async.train_workers=%d > 1 "
                    "(two CPU trainers restarting from a shared cache ran mismatched collectives)",
                    cfg.async_.train_workers)
        env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    return env


def _make_actors(cfg: DriverConfig, run_dir: str, queues: dict[str, Any], bind_ip: str | None) -> tuple[list[Any], Any]:
    tpu = _tpu_hosts() if cfg.run.platform in ("auto", "tpu") else []
    env = host_env()
    if tpu:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        chips = int(tpu[0]["Resources"]["TPU"])
        n = len(tpu)
        pg = placement_group([{"TPU": chips, "CPU": 1}] * n, strategy="STRICT_SPREAD")
        ray.get(pg.ready(), timeout=cfg.run.startup_timeout_s)
        Actor = ray.remote(HostActor)
        # max_concurrency=2: `dump_stacks` must run while `run` is busy (the stall detector's stack dumps).
        actors = [Actor.options(num_cpus=1, resources={"TPU": chips}, runtime_env={"env_vars": env}, max_concurrency=2,
                                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)
                                ).remote(i, n, cfg.host, run_dir, queues, bind_ip) for i in range(n)]
        return actors, pg
    n = cfg.run.hosts
    if cfg.run.platform == "gpu":
        Actor = ray.remote(HostActor)
        actors = [Actor.options(**gpu_host_options(cfg, env)).remote(i, n, cfg.host, run_dir, queues, bind_ip)
                  for i in range(n)]
        return actors, None
    env |= cpu_host_env(cfg)
    # Simulated hosts take no CPU reservation: a 2-core laptop must fit every one of them.
    Actor = ray.remote(HostActor)
    actors = [Actor.options(num_cpus=0, max_restarts=0, max_concurrency=2, runtime_env={"env_vars": env}
                            ).remote(i, n, cfg.host, run_dir, queues, bind_ip)
              for i in range(n)]
    return actors, None


def _teardown(actors: list[Any], queues: dict[str, Any], pg: Any, hosts: list[dict[str, Any]] | None = None,
              sink: MetricsSink | None = None) -> None:
    """End an attempt, in an order that loses nothing: the hosts first (a trainer that outlived a failed peer may
    still publish a row and save its checkpoint), waited for until they are gone, so the checkpoint the next attempt
    resumes from can no longer change; then the rows they published are drained into `sink`; then the queues."""
    for a in actors:
        try:
            ray.kill(a, no_restart=True)
        except Exception:
            pass
    _wait_dead(actors)
    # Simulated hosts run on this machine: make sure none survives its actor (a process that is still exiting can
    # hang in a collective with a dead peer). Remote hosts are their raylets' business.
    here = socket.gethostname()
    local = [h["pid"] for h in hosts or [] if h.get("host") == here and h.get("pid") and h["pid"] != os.getpid()]
    deadline = time.monotonic() + 5.0  # ray.kill is asynchronous: a killed actor needs a moment to go
    while local and time.monotonic() < deadline and any(_alive(p) for p in local):
        time.sleep(0.1)
    for h in hosts or []:
        if h.get("pid") in local and _alive(h["pid"]):
            try:
                os.kill(h["pid"], signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    if sink is not None and "driver" in queues:
        try:
            for row in queues["driver"].drain():
                sink.write(row)
        except Exception as e:  # noqa: BLE001 - a dead queue actor: its rows are lost, the teardown goes on
            log.warning("could not drain the driver queue after the hosts stopped: %r", e)
    if queues:  # every queue lives in one hub actor
        try:
            ray.kill(next(iter(queues.values())).q.hub, no_restart=True)
        except Exception:
            pass
    if pg is not None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(pg)


def _wait_dead(actors: list[Any], timeout_s: float = 30.0) -> None:
    """`ray.kill` is asynchronous: wait until Ray reports each killed host dead (its calls fail), so that on a real
    cluster an old trainer cannot write a checkpoint after the driver has picked the step to resume from."""
    deadline = time.monotonic() + timeout_s
    for a in actors:
        while time.monotonic() < deadline:
            try:
                ray.get(a.ping.remote(), timeout=1.0)
            except ray.exceptions.GetTimeoutError:
                continue
            except Exception:  # noqa: BLE001 - RayActorError (dead), or not an actor at all
                break
            time.sleep(0.1)  # it still answers


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (killed, not yet reaped) has exited
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def _attempt(cfg: DriverConfig, run_dir: str, sink: MetricsSink, bind_ip: str | None) -> dict[str, Any]:
    """One try at the run. `bind_ip`: where the hosts listen (the coordinator, the transfer sockets); None = their
    node's IP."""
    n_hosts = len(_tpu_hosts()) if (cfg.run.platform in ("auto", "tpu") and _tpu_hosts()) else cfg.run.hosts
    tw = cfg.async_.train_workers
    if not (0 < tw < n_hosts and n_hosts % tw == 0):
        raise ValueError(f"async.train_workers={tw} must be in (0, {n_hosts}) and divide the {n_hosts} hosts")
    queues = make_queues(cfg.prompts_per_step, n_hosts - tw, cfg.async_.rollout_queue_size, cfg.async_.queue_timeout_s,
                         eval_prompts=cfg.eval_prompts)
    actors, pg = _make_actors(cfg, run_dir, queues, bind_ip)
    info: list[dict[str, Any]] = []
    try:
        timeout = cfg.run.startup_timeout_s
        info = _startup([a.ping.remote() for a in actors], tw, "the startup ping", timeout)
        (port,) = _startup([actors[0].free_port.remote()], tw, "the request for a coordinator port", timeout)
        coordinator = f"{info[0]['ip']}:{port}"
        log.debug("joining %d hosts via jax.distributed at %s", len(actors), coordinator)
        joined = _startup([a.start_jax.remote(coordinator, timeout) for a in actors], tw, "the jax.distributed join",
                          timeout + 30)
        # Who is who, and what each listens on (the JAX coordinator on rank 0, the CPU transfer sockets).
        hosts = [{**h, "role": role_of(h["rank"], tw), "listen": j["listen"]} for h, j in zip(info, joined)]
        jsonl.write_json(os.path.join(run_dir, "hosts.json"), hosts)  # who is who (pids for debugging and tests)
        jsonl.append(os.path.join(run_dir, "hosts_history.jsonl"), [{"time": time.time(), "hosts": hosts}])
        refs = {a.run.remote(): i for i, a in enumerate(actors)}
        stall = cfg.run.stall_timeout_s
        last_progress = time.monotonic()
        while True:
            for row in queues["driver"].drain():
                sink.write(row)
                last_progress = time.monotonic()
            if stall and time.monotonic() - last_progress > stall:
                _dump_stacks(actors, info, run_dir)
                raise RunStalled(f"no step published for {stall:.0f}s (run.stall_timeout_s); every host's thread "
                                 f"stacks are above and in {os.path.join(run_dir, 'stacks.txt')}")
            ready, _ = ray.wait(list(refs), timeout=0.5)
            for ref in ready:
                rank = refs.pop(ref)
                for row in queues["driver"].drain():  # rows published before a failure are kept
                    sink.write(row)
                failure = failure_of(ref, rank, info, tw)
                if failure is not None:
                    raise root_cause(failure, refs, info, tw)
                if rank == 0:  # its rows were drained just above, after it had returned
                    report_late_failures(refs, info, tw)
                    return ray.get(ref).info
    finally:
        _teardown(actors, queues, pg, info, sink)


def _startup(refs: list[Any], tw: int, what: str, timeout_s: float) -> list[Any]:
    """The results of one startup call per host (rank order). A host that dies, raises, or does not answer in
    time is a HostFailure naming it, which the driver restarts like any other (`run.max_restarts`): startup is part
    of the attempt. Results are taken as they come, so the host that failed is the one named, not a peer left
    waiting for it (a jax.distributed join waits for every process)."""
    rank_of = {ref: i for i, ref in enumerate(refs)}
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            rank = rank_of[pending[0]]
            raise HostFailure(rank, role_of(rank, tw), f"did not answer {what} within {timeout_s:g}s "
                                                       "(run.startup_timeout_s)")
        rank = rank_of[ready[0]]
        try:
            out[rank] = ray.get(ready[0])
        except ray.exceptions.RayActorError as e:
            raise HostFailure(rank, role_of(rank, tw), f"died during {what} ({type(e).__name__})", died=True) from None
        except ray.exceptions.RayTaskError as e:
            first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise HostFailure(rank, role_of(rank, tw), f"failed in {what}: {first}", str(e)) from None
    return [out[i] for i in range(len(refs))]


def _dump_stacks(actors: list[Any], info: list[dict[str, Any]], run_dir: str) -> None:
    """Every host's Python thread stacks, to stderr and run_dir/stacks.txt (a host that cannot answer says so)."""
    refs = [a.dump_stacks.remote() for a in actors]
    parts = []
    for i, ref in enumerate(refs):
        try:
            text = ray.get(ref, timeout=30)
        except Exception as e:  # noqa: BLE001 - a wedged or dead host is reported, not fatal here
            text = f"(no answer: {type(e).__name__}: {e})"
        parts.append(f"==== host {i} ({info[i]['role']}, pid {info[i]['pid']} on {info[i]['host']}) ====\n{text}")
    out = "\n".join(parts)
    with open(os.path.join(run_dir, "stacks.txt"), "w") as f:
        f.write(out)
    print(out, file=sys.stderr)


def run(cfg: DriverConfig, config_yaml: str) -> int:
    """The run, restarted from its latest checkpoint on a host failure (`run.max_restarts`); `config_yaml` is the
    resolved config, written to the run dir."""
    logs.configure(cfg.logging.level, "%(asctime)s [driver] %(message)s")
    # Before anything starts: a bad environment fails here, naming its key, and the user's packages are found.
    py_modules = plugins.import_environments(cfg.host.inference.task, cfg.host.inference.agent.fn)
    run_dir = run_dir_of(cfg)
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "config.yaml"), "w") as f:
        f.write(config_yaml)
    if not cfg.resume:  # a fresh start: the checkpoints and the KL reference of an earlier run go
        for d in ("checkpoints", "reference"):
            if os.path.isdir(os.path.join(run_dir, d)):
                shutil.rmtree(os.path.join(run_dir, d))
    started = _connect(cfg, py_modules)
    restarts = 0
    code = 0
    sink: MetricsSink | None = None
    try:
        while True:
            resume_step = latest_checkpoint(run_dir) if cfg.resume else None
            # Every log back to the checkpoint this attempt starts from (the metrics rows: MetricsSink, below).
            rollout_log.truncate(run_dir, resume_step or 0)
            evals.truncate(run_dir, resume_step or 0)
            if resume_step:  # before the bar, which draws itself at once
                print(f"[asyncrl] resuming {run_dir} from checkpoint step {resume_step}", file=sys.stderr)
            progress = Progress(cfg.total_steps, resume_step or 0, cfg.logging.progress_every_n_steps) \
                if cfg.logging.progress else None
            sink = MetricsSink(run_dir, cfg.logging.tensorboard, progress,
                               resume_from=resume_step if resume_step is not None else 0)
            try:
                _attempt(cfg, run_dir, sink, LOOPBACK if started else None)
                break
            except RunStalled as e:
                print(f"[asyncrl] error: {e}", file=sys.stderr)
                code = 1
                break
            except HostFailure as e:
                sink.close()
                if e.traceback:  # the host's own traceback (a dead feeder thread's included), then the summary line
                    print(f"[asyncrl] host {e.rank} ({e.role}) error:\n{e.traceback.rstrip()}", file=sys.stderr)
                if restarts < cfg.run.max_restarts:
                    restarts += 1
                    print(f"[asyncrl] {e}; restarting all hosts from the latest checkpoint "
                          f"({restarts}/{cfg.run.max_restarts})", file=sys.stderr)
                    cfg = cfg.with_resume()
                    continue
                print(f"[asyncrl] error: {e}; no restarts left (run.max_restarts={cfg.run.max_restarts})",
                      file=sys.stderr)
                code = 1
                break
        if sink is not None:
            if sink.progress is not None:
                sink.progress.close()  # the bar's last state stays above the summary
            print(sink.summary())
            plot = sink.plot()
            if plot:
                print(f"reward curve: {plot}")
            print(f"metrics: {sink.path}")
            sink.close()
    finally:
        if started:
            ray.shutdown()
    return code

