"""Ray-actor-backed bounded queues: the blog's multiprocessing-manager queues, without a hand-made RPC server.

Every queue of a run lives in one async Ray actor (`QueueHub`): items travel over Ray's authenticated channels, and
nothing is pickled over an open port. One actor rather than one per queue (as `ray.util.queue.Queue` would make):
each actor is a Python process that imports Ray, about 2 CPU-seconds and 100 MB at every launch, and a run has 8
queues. The actor is async, so a get that waits on an empty queue does not hold up a put on another. Every blocking
call has a timeout, and a timeout says which role waited for what on which queue.
"""

from __future__ import annotations

import asyncio
import queue as std_queue
import time
from dataclasses import dataclass
from typing import Any

import ray

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


class Empty(std_queue.Empty):
    pass


class Full(std_queue.Full):
    pass


class QueueHub:
    """The actor behind every queue of a run (wrapped with `ray.remote` in `make_queues`)."""

    def __init__(self, sizes: dict[str, int]):
        self.queues = {n: asyncio.Queue(m) for n, m in sizes.items()}

    def qsize(self, name: str) -> int:
        return self.queues[name].qsize()

    async def put(self, name: str, item: Any, timeout: float | None) -> None:
        try:
            await asyncio.wait_for(self.queues[name].put(item), timeout)
        except TimeoutError:
            raise Full from None

    async def get(self, name: str, timeout: float | None) -> Any:
        try:
            return await asyncio.wait_for(self.queues[name].get(), timeout)
        except TimeoutError:
            raise Empty from None

    def get_nowait(self, name: str) -> Any:
        try:
            return self.queues[name].get_nowait()
        except asyncio.QueueEmpty:
            raise Empty from None


@dataclass(frozen=True)
class HubQueue:
    """One named queue of the hub: what a role holds (it pickles with the actor handle into every host)."""

    hub: Any  # ray.actor.ActorHandle of a QueueHub
    name: str
    maxsize: int

    def put(self, item: Any, timeout: float | None) -> None:
        ray.get(self.hub.put.remote(self.name, item, timeout))

    def get(self, timeout: float | None) -> Any:
        return ray.get(self.hub.get.remote(self.name, timeout))

    def get_nowait(self) -> Any:
        return ray.get(self.hub.get_nowait.remote(self.name))

    def qsize(self) -> int:
        return ray.get(self.hub.qsize.remote(self.name))



RPC = {"calls": 0.0, "seconds": 0.0}
"""This process's non-blocking queue calls (`get_nowait`) and their seconds: one round trip to a queue actor each,
the cost every prompt and group pays per hop (logged for `launch.py plan`)."""


@dataclass
class RoleQueue:
    """A queue handle that knows who is using it, for error messages."""

    name: str
    q: HubQueue
    role: str = "?"
    default_timeout: float = 300.0

    def as_role(self, role: str, default_timeout: float | None = None) -> RoleQueue:
        return RoleQueue(self.name, self.q, role, default_timeout or self.default_timeout)

    def put(self, item: Any, timeout: float | None = None) -> None:
        t = self.default_timeout if timeout is None else timeout
        try:
            self.q.put(item, timeout=t)
        except Full:
            raise QueueTimeout(f"{self.role} waited {t:.0f}s to put on the full '{self.name}' queue "
                               f"(size {self.q.maxsize}); its consumer is stalled") from None

    def get(self, timeout: float | None = None) -> Any:
        t = self.default_timeout if timeout is None else timeout
        try:
            return self.q.get(timeout=t)
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
            return self.q.get(timeout=timeout)
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
    """Create every queue, each bounded, in one hub actor. It takes no CPU, so it never blocks placement."""
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
    # max_concurrency: every host may block in a get or a put at once (Ray's default for async actors is 1000).
    hub = ray.remote(QueueHub).options(num_cpus=0, max_concurrency=1000).remote(sizes)
    return {n: RoleQueue(n, HubQueue(hub, n, sizes[n]), "driver", timeout) for n in NAMES}
