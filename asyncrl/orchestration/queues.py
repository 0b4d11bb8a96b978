"""Ray-actor-backed bounded queues: the blog's multiprocessing-manager queues, without a hand-made RPC server.

Each queue is a `ray.util.queue.Queue` (itself an actor), so items travel through Ray's object store over Ray's
authenticated channels; nothing is pickled over an open port. Every blocking call has a timeout, and a timeout
says which role waited for what on which queue.
"""

from __future__ import annotations

import queue as std_queue
import time
from dataclasses import dataclass
from typing import Any

from ray.util.queue import Empty, Full, Queue

NAMES = (
    "prompt",  # trainer -> inference: train prompts (bounded: prompts per step)
    "rollout",  # inference -> trainer: scored groups
    "weight_sync",  # trainer -> inference: "a transfer is coming" (bounded: inference hosts)
    "inference_metrics",  # inference -> trainer
    "eval_prompt",  # trainer -> inference, served before train prompts (bounded: one eval round)
    "eval_rollout",  # inference -> trainer (bounded: one eval round)
    "consumed",  # trainer ranks > 0 -> the feeder on rank 0: (data position, dropped) of each group taken
    "driver",  # trainer -> driver: per-step metrics for the live progress line and the files
)

DRIVER_QUEUE_SIZE = 256  # rows the driver may fall behind (it drains twice a second)
METRICS_QUEUE_SIZE = 64  # inference reports; a full queue drops a report, never blocks decode


class QueueTimeout(TimeoutError):
    pass


RPC = {"calls": 0.0, "seconds": 0.0}
"""This process's non-blocking queue calls (`get_nowait`) and their seconds: one round trip to a queue actor each,
the cost every prompt and group pays per hop (logged for `launch.py plan`)."""


@dataclass
class RoleQueue:
    """A queue handle that knows who is using it, for error messages."""

    name: str
    q: Queue
    role: str = "?"
    default_timeout: float = 300.0

    def as_role(self, role: str, default_timeout: float | None = None) -> RoleQueue:
        return RoleQueue(self.name, self.q, role, default_timeout or self.default_timeout)

    def put(self, item: Any, timeout: float | None = None) -> None:
        t = self.default_timeout if timeout is None else timeout
        try:
            self.q.put(item, block=True, timeout=t)
        except Full:
            raise QueueTimeout(f"{self.role} waited {t:.0f}s to put on the full '{self.name}' queue "
                               f"(size {self.q.maxsize}); its consumer is stalled") from None

    def get(self, timeout: float | None = None) -> Any:
        t = self.default_timeout if timeout is None else timeout
        try:
            return self.q.get(block=True, timeout=t)
        except Empty:
            raise QueueTimeout(f"{self.role} waited {t:.0f}s for an item on the '{self.name}' queue; "
                               "its producer is stalled or gone") from None

    def get_nowait(self) -> Any:
        """Raises queue.Empty (the standard one) when empty."""
        t0 = time.perf_counter()
        try:
            return self.q.get_nowait()
        except Empty:
            raise std_queue.Empty from None
        finally:
            RPC["calls"] += 1
            RPC["seconds"] += time.perf_counter() - t0

    def poll(self, timeout: float) -> Any | None:
        """Like get, but None instead of an error on timeout (for loops that also check other things)."""
        try:
            return self.q.get(block=True, timeout=timeout)
        except Empty:
            return None

    def drain(self) -> list[Any]:
        out = []
        while True:
            try:
                out.append(self.q.get_nowait())
            except Empty:
                return out

    def qsize(self) -> int:
        return self.q.qsize()



def make_queues(prompts_per_step: int, inference_hosts: int, rollout_size: int = 0, timeout: float = 300.0,
                eval_prompts: int = 64) -> dict[str, RoleQueue]:
    """Create every queue, each bounded. Actors take no CPU so they never block placement."""
    sizes = {
        "prompt": prompts_per_step,
        "weight_sync": inference_hosts,
        "rollout": rollout_size or 2 * prompts_per_step,
        "eval_prompt": eval_prompts,
        "eval_rollout": eval_prompts,
        "inference_metrics": METRICS_QUEUE_SIZE,
        "consumed": 4 * prompts_per_step,
        "driver": DRIVER_QUEUE_SIZE,
    }
    assert all(v > 0 for v in sizes.values()), sizes  # 0 would mean unbounded to ray.util.queue
    return {n: RoleQueue(n, Queue(maxsize=sizes[n], actor_options={"num_cpus": 0}), "driver", timeout) for n in NAMES}
