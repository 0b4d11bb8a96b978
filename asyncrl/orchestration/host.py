"""The one actor per host: a JAX process that joins jax.distributed and then runs its role.

Ranks below `async.train_workers` train; the rest run inference. Results cross the actor boundary as typed
`HostResult`s, never as bare exceptions or silent hangs (levanter's TpuSuccess/TpuFailed idea).
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from asyncrl.orchestration import faults, logs
from asyncrl.orchestration.role_config import HostConfig

log = logging.getLogger(__name__)


@dataclass
class HostResult:
    rank: int
    role: str
    ok: bool
    error: str = ""
    info: dict[str, Any] = field(default_factory=dict)


def role_of(rank: int, train_workers: int) -> str:
    return "trainer" if rank < train_workers else "inference"


class HostActor:
    """Wrapped with `ray.remote` by the driver (resources depend on the cluster)."""

    def __init__(self, rank: int, n_hosts: int, cfg: HostConfig, run_dir: str, queues: dict[str, Any],
                 bind_ip: str | None = None):
        """`bind_ip`: the address this host listens on (JAX coordinator, CPU transfer socket): 127.0.0.1 in the
        driver's own local cluster, None (the Ray node's IP) on a real one."""
        self.rank, self.n_hosts, self.cfg, self.run_dir, self.queues = rank, n_hosts, cfg, run_dir, queues
        self.ip = bind_ip or _node_ip()
        self.loopback = bind_ip is not None
        self.role = role_of(rank, cfg.train_workers)
        logs.configure(cfg.log_level, f"%(asctime)s [{self.role}{rank}] %(name)s: %(message)s")

    def ping(self) -> dict[str, Any]:
        return {"rank": self.rank, "role": self.role, "pid": os.getpid(), "host": socket.gethostname(),
                "ip": self.ip}

    def free_port(self) -> int:
        from asyncrl.weightsync.transfer import free_port

        return free_port(self.ip if self.loopback else "")

    def dump_stacks(self) -> str:
        """Every Python thread's stack in this process (runs beside `run`: the actor has two threads)."""
        import sys
        import threading

        names = {t.ident: t.name for t in threading.enumerate()}
        out = []
        for ident, frame in sys._current_frames().items():
            out.append(f"--- thread {names.get(ident, ident)} ---\n" + "".join(traceback.format_stack(frame)))
        return "\n".join(out)

    def start_jax(self, coordinator: str, timeout_s: float) -> dict[str, Any]:
        import jax

        from asyncrl.weightsync.transfer import enable_cpu_transfers

        faults.point("startup", self.rank, 0, self.run_dir)
        if self.cfg.platform == "cpu" or os.environ.get("JAX_PLATFORMS") == "cpu":
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
            enable_cpu_transfers(self.ip)
        t0 = time.time()
        # JAX's coordinator service (on rank 0) binds to every interface ([::]) unless told otherwise.
        bind = f"{self.ip}:{coordinator.rsplit(':', 1)[1]}" if self.loopback else None
        jax.distributed.initialize(coordinator, num_processes=self.n_hosts, process_id=self.rank,
                                   initialization_timeout=int(timeout_s), coordinator_bind_address=bind)
        # JAX's own exit hook waits at a shutdown barrier for every process of the job; once a peer host is dead
        # (the very case a restart follows) it waits forever and the process outlives the driver. This hook is
        # registered later, so it runs first: flush, then leave without the barrier.
        atexit.register(_exit_now)
        from jax._src import xla_bridge  # the flag has no public getter; read back for hosts.json only

        listen = {"transfer_socket": xla_bridge.CROSS_HOST_TRANSFER_SOCKET_ADDRESS.value or None}
        if self.rank == 0:
            listen["jax_coordinator"] = bind or f"[::]:{coordinator.rsplit(':', 1)[1]}"
        return {"rank": self.rank, "process_index": jax.process_index(), "local_devices": jax.local_device_count(),
                "devices": jax.device_count(), "join_s": time.time() - t0, "listen": listen}

    def run(self) -> HostResult:
        if os.environ.get("ASYNCRL_STACK_DUMP_S"):  # debugging hangs: periodic stack dumps of every thread
            import faulthandler

            faulthandler.dump_traceback_later(float(os.environ["ASYNCRL_STACK_DUMP_S"]), repeat=True)
        try:
            if self.role == "trainer":
                from asyncrl.orchestration.trainer_worker import TrainerWorker

                info = TrainerWorker(self.cfg.trainer, self.rank, self.run_dir, self.queues).run()
            else:
                from asyncrl.orchestration.inference_worker import InferenceWorker

                info = InferenceWorker(self.cfg.inference, self.rank, self.run_dir, self.queues).run()
            return HostResult(self.rank, self.role, True, info=info or {})
        except BaseException as e:  # typed result instead of a bare exception crossing the boundary
            log.exception("host %d (%s) failed", self.rank, self.role)
            return HostResult(self.rank, self.role, False, error=f"{type(e).__name__}: {e}\n{traceback.format_exc()}")


def _exit_now() -> None:
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass
    os._exit(0)


def _node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:
        return "127.0.0.1"
