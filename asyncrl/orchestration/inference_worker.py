"""The inference role (the blog's AsyncInferenceWorker): replicas decoding continuously, each sample in its
environment (`asyncrl/envs`: a single-turn task's is its verifier, stepped off the decode thread by the engine), a
monitor thread for weight sync, and shipper threads that put finished groups on the trainer's queues.

Weight sync, as in the blog: the monitor takes the trainer's signal, opens the gate (`SyncGate`) and waits until
every replica has parked between two decode chunks; it frees the old weights, receives the new ones through the
hop chain, bumps the version and releases the gate. Each replica then takes a zero-copy reference to its own
shards and carries on with its in-flight rows under the new weights (their per-token versions record where).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

import jax

from asyncrl.envs import Environments, build_sources, combine, source_of
from asyncrl.envs.registry import is_agent
from asyncrl.inference.engine import Engine, Request
from asyncrl.inference.replicas import ReplicaSet
from asyncrl.orchestration import faults
from asyncrl.orchestration.messages import InferenceReport, WeightSync
from asyncrl.orchestration.queues import RPC, QueueTimeout
from asyncrl.orchestration.role_config import InferenceRoleConfig
from asyncrl.rollout import Rollout
from asyncrl.sharding.roles import split_roles
from asyncrl.tasks import Verifier

log = logging.getLogger(__name__)


class SyncGate:
    """Parks the replicas while new weights arrive, counted per sync so that back-to-back syncs cannot strand one.

    The monitor opens sync k (`requested = k`) and waits until every replica has parked for it; each replica parks
    at most once per sync and waits until `released >= k`. With a boolean event instead, a replica that had not yet
    seen sync k end when sync k+1 began (the trainer signals the next sync as soon as the last one lands) kept
    waiting on the re-set event, its park for k+1 never counted, and the whole job stalled."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.requested = 0  # syncs the monitor has opened
        self.released = 0  # syncs whose weights have landed (or that failed)
        self.parked = 0  # replicas parked for sync `requested`
        self.lock = threading.Lock()  # guards params / version
        self.params: Any = None
        self.version = -1

    def open(self) -> None:
        with self.cond:
            self.requested += 1
            self.parked = 0
            self.cond.notify_all()

    def release(self) -> None:
        with self.cond:
            self.released = self.requested
            self.cond.notify_all()

    def pending(self) -> bool:
        return self.requested > self.released


class InferenceWorker:
    def __init__(self, cfg: InferenceRoleConfig, rank: int, run_dir: str, queues: dict[str, Any]):
        self.cfg, self.rank, self.run_dir = cfg, rank, run_dir
        t = cfg.async_.queue_timeout_s
        self.q = {k: v.as_role(f"inference{rank}", t) for k, v in queues.items()}
        self.gate = SyncGate()
        self.sync_stats: dict[str, float] = {}
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.timeout_s = t
        # Separate lanes: a train rollout blocked on the full (bounded) rollout queue must never hold up eval.
        self.lanes: dict[bool, queue.Queue[Rollout]] = {
            True: queue.Queue(maxsize=max(1, cfg.eval_prompts)), False: queue.Queue(maxsize=256)}
        self.agents: Any = None  # `endpoint.host.HostAgents` when a source is played by the agent function

    # ---- weight sync ----------------------------------------------------------------------------------------

    def _monitor(self) -> None:
        try:
            while not self.stop.is_set():
                msg: WeightSync | None = self.q["weight_sync"].poll(0.5)
                if msg is None:
                    continue
                t0 = time.perf_counter()
                n = len(self.replicas.engines) if self.replicas is not None else 0
                park = self.cfg.async_.park_timeout_s
                self.gate.open()
                with self.gate.cond:
                    ok = self.gate.cond.wait_for(lambda: self.gate.parked >= n, timeout=park)
                if not ok:
                    raise TimeoutError(f"inference{self.rank} monitor waited {park:g}s (async.park_timeout_s) for "
                                       f"{n} replicas to park for weight sync v{msg.version} (got {self.gate.parked})")
                parked_s = time.perf_counter() - t0
                faults.point("weight_sync", self.rank, msg.version, self.run_dir)
                with self.gate.lock:
                    if self.gate.params is not None:  # free the old weights before the new ones land
                        jax.tree.map(lambda x: x.delete(), self.gate.params)
                        self.gate.params = None
                    got, _ = self.transfer.transfer(None, self.payload.shapes(msg.full), version=msg.version)
                    self.gate.params, self.gate.version = self.payload.params(got, msg.version), msg.version
                self.gate.release()
                self.sync_stats = {"park_s": parked_s, "sync_s": time.perf_counter() - t0}
                log.debug("weights v%d received in %.2fs (replicas parked in %.2fs)", self.gate.version,
                          time.perf_counter() - t0, parked_s)
        except BaseException as e:
            self.errors.append(e)
            self.stop.set()
            self.gate.release()

    def _await_first_weights(self) -> None:
        """The first sync delivers the trainer's initial weights; it comes once the trainer is built."""
        limit = self.cfg.weightsync.first_sync_timeout_s
        deadline = time.monotonic() + limit
        while self.gate.params is None:
            if self.errors:
                raise self.errors[0]
            if time.monotonic() > deadline:
                raise TimeoutError(f"inference{self.rank} waited {limit:g}s (weightsync.first_sync_timeout_s) for its "
                                   "first weights from the trainer; the trainer never finished building or never "
                                   "started its first sync")
            time.sleep(0.05)

    def _maybe_update(self, engine: Engine) -> None:
        """Called by each replica between decode loops (the engine's `between_loops` hook)."""
        if self.errors:
            raise RuntimeError(f"inference{self.rank} stopped: {self.errors[0]!r}")
        if not self.gate.pending() and engine.version == self.gate.version:
            return
        with self.gate.cond:
            if self.gate.pending():  # park once for the sync open now, and wait for that sync alone
                k = self.gate.requested
                self.gate.parked += 1
                self.gate.cond.notify_all()
                # The monitor releases every sync it opens, on success or failure, within its own deadlines (the
                # barriers and every hop's bucket: weightsync.timeout_s each); this one is the replica's own.
                limit = self.cfg.async_.park_timeout_s + 3 * self.cfg.weightsync.timeout_s
                deadline = time.monotonic() + limit
                while self.gate.released < k and not self.stop.is_set():
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"{engine.name} of inference{self.rank} stayed parked {limit:g}s for weight sync #{k} "
                            "(async.park_timeout_s + 3 x weightsync.timeout_s); the weight-sync monitor is wedged")
                    self.gate.cond.wait(0.1)  # a slice: a stop set elsewhere notifies no one
        with self.gate.lock:
            if self.gate.params is not None and engine.version != self.gate.version:
                engine.set_params(self.gate.params, self.gate.version)

    # ---- shipping -------------------------------------------------------------------------------------------

    def _push(self, is_eval: bool) -> None:
        lane = self.lanes[is_eval]
        try:
            while not self.stop.is_set():
                try:
                    rollout = lane.get(timeout=0.2)
                except queue.Empty:
                    continue
                target = "eval_rollout" if rollout.is_eval else "rollout"
                deadline = time.monotonic() + self.timeout_s
                while not self.stop.is_set():  # short slices, so a stop is seen; then give up with a clear error
                    try:
                        self.q[target].put(rollout, timeout=1.0)
                        break
                    except TimeoutError:
                        if time.monotonic() > deadline:
                            raise QueueTimeout(
                                f"inference{self.rank} shipper waited {self.timeout_s:.0f}s (async.queue_timeout_s) to "
                                f"put a group on the full '{target}' queue; no trainer is taking groups") from None
        except BaseException as e:
            self.errors.append(e)
            self.stop.set()

    def _on_group(self, r: Rollout, engine: Engine) -> None:
        """Hand a finished (graded) group to its shipping lane. This blocks decode when shipping falls behind
        (back-pressure), but never forever, and never past a weight sync: the wait comes in slices, and between them
        the replica parks if a sync is pending (`_maybe_update`), so a sync waits one decode chunk at most."""
        lane = "eval" if r.is_eval else "train"
        self._parkable(engine, lambda t=None: self.lanes[r.is_eval].put(r, timeout=t), queue.Full, self.timeout_s,
                       f"to hand a finished group to the {lane} shipping lane (async.queue_timeout_s); the shipper "
                       "is stalled", QueueTimeout)

    def _parkable(self, engine: Engine, call: Any, full: type, limit_s: float, what: str,
                  error: type = TimeoutError) -> Any:
        """`call(t)` retried in slices of at most 0.2 s while it raises `full`, parking the replica for any weight
        sync in between; after `limit_s` in all, `error` naming the waiter."""
        deadline = time.monotonic() + limit_s
        while True:
            try:
                return call(t=min(0.2, max(0.0, deadline - time.monotonic())))
            except full:
                if time.monotonic() >= deadline:
                    raise error(f"{engine.name} of inference{self.rank} waited {limit_s:g}s {what}") from None
                self._maybe_update(engine)

    # ---- replica loop ---------------------------------------------------------------------------------------

    def _next_requests(self, wait: bool) -> list[Request]:
        """Up to max_prefill_prompts prompts, eval prompts first. `wait`: block up to 50 ms for one (an idle
        replica); a replica with rows in flight must not, or every decode call behind an empty queue pays 50 ms
        (measured at max_lag 0, where the queue is empty for most of a step: 2.4 s steps of 0.13 s of training)."""
        P = self.cfg.inference.max_prefill_prompts
        items = []
        while len(items) < P:  # eval prompts first
            try:
                items.append(self.q["eval_prompt"].get_nowait())
            except queue.Empty:
                break
        if not items:
            if wait:
                item = self.q["prompt"].poll(0.05)
            else:
                try:
                    item = self.q["prompt"].get_nowait()
                except queue.Empty:
                    item = None
            if item is not None:
                items.append(item)
        while items and len(items) < P:  # top up without waiting
            try:
                items.append(self.q["prompt"].get_nowait())
            except queue.Empty:
                break
        reqs = []
        for p in items:
            if self.agents is not None and is_agent(source_of(self.sources, p.sample)):
                self.agents.submit(p)  # its agents call the endpoint: their requests come back through `take`
            else:
                reqs.append(Request(p, *self.envs.open(p.sample, p.n)))
        return reqs

    def _agent_group(self, r: Rollout) -> None:
        """An agent group, played: onto its shipping lane (from an agent-group thread, which may block)."""
        try:
            self.lanes[r.is_eval].put(r, timeout=self.timeout_s)
        except queue.Full:
            self._fail(QueueTimeout(f"inference{self.rank} waited {self.timeout_s:g}s (async.queue_timeout_s) to "
                                    "hand an agent group to its shipping lane; the shipper is stalled"))

    def _fail(self, e: BaseException) -> None:
        self.errors.append(e)
        self.stop.set()

    def _replica_loop(self, engine: Engine) -> None:
        try:
            slow = faults.slowdown(self.rank)  # fault injection: a slow host (0 in normal runs)
            engine.between_loops = (lambda: self._maybe_update(engine)) if not slow else \
                (lambda: (time.sleep(slow), self._maybe_update(engine)))
            on_group = lambda r: self._on_group(r, engine)  # noqa: E731
            served = self.agents.loop if self.agents is not None and self.agents.loop.engine is engine else None
            if served is not None:  # the endpoint's groups go back to their requests, the rest ship
                on_group = lambda r: served.finish(r) or self._on_group(r, engine)  # noqa: E731
            last_report = time.time()
            while not self.stop.is_set():
                engine.between_loops()
                reqs = served.take(wait=False) if served is not None else []
                reqs += self._next_requests(wait=not engine.busy and not reqs)
                if reqs:
                    engine.generate(reqs, drain=False, on_group=on_group)
                elif engine.busy:
                    engine.advance(on_group=on_group)  # no new prompts: finish rows and episodes instead of idling
                if time.time() - last_report > 2.0:
                    self._report(engine)
                    last_report = time.time()
        except BaseException as e:
            if self.agents is not None and self.agents.loop.engine is engine:
                self.agents.loop.fail(e)
            self.errors.append(e)
            self.stop.set()

    def _report(self, engine: Engine) -> None:
        s = engine.stats
        m = InferenceReport(engine.name, s.generated_tokens / max(s.decode_time, 1e-9), float(s.finished),
                            float(s.decode_steps), float(engine.version), float(engine.in_flight), s.prefill_time,
                            {f"weight_sync_{k}": v for k, v in self.sync_stats.items()},
                            {"t": time.time(), "decode_time_s": s.decode_time, "decode_steps": float(s.decode_steps),
                             "slot_steps": float(s.slot_steps), "prefill_s": s.prefill_time,
                             "prefill_calls": float(s.prefill_calls), "extend_s": s.extend_time,
                             "fed_tokens": float(s.fed_tokens),  # observation tokens, in slot_steps
                             "generated_tokens": float(s.generated_tokens), "queue_rpc_s": RPC["seconds"],
                             "queue_rpc_calls": RPC["calls"], "engine_s": s.engine_time,
                             "decode_calls": float(s.calls)})
        try:
            self.q["inference_metrics"].put(m, timeout=1.0)
        except TimeoutError:
            pass

    def _grade(self, answer: str, sample: Any) -> float:
        """An agent's text answer, graded by the task's verifier."""
        return float(self.verifier.submit(answer, sample).result(timeout=self.cfg.task.verifier.timeout_s * 4 + 30)
                     .reward)

    # ---- main -----------------------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        from asyncrl.models.sources import load_tokenizer, model_config
        from asyncrl.models.transformer import Model
        from asyncrl.orchestration.payload import SyncPayload
        from asyncrl.train.mesh import make_train_mesh
        from asyncrl.weightsync.transfer import HopChainTransfer

        cfg = self.cfg
        mcfg = model_config(cfg.model)
        self.tokenizer = load_tokenizer(cfg.model, self.run_dir)
        self.sources = sources = build_sources(cfg.task)
        self.task = combine(sources, cfg.task)
        self.verifier = Verifier(self.task, cfg.task.verifier)
        self.envs = Environments(sources, self.tokenizer, self.verifier, chat=cfg.task.prompt_template == "chat",
                                 step_timeout_s=cfg.task.verifier.timeout_s * 4 + 30, tools=cfg.tools)
        # Slot 0 in the trainer mesh's order, as the trainers lay it out (their cast is the first hop's input).
        trainer_mesh = make_train_mesh(cfg.train_mesh, split_roles(jax.devices(), cfg.async_.train_workers)
                                       .trainer_devices)
        self.transfer = HopChainTransfer(cfg.async_.train_workers, jax.devices(), bucket_mb=cfg.weightsync.bucket_mb,
                                         timeout_s=cfg.weightsync.timeout_s, first_slot=trainer_mesh.devices.flat)
        self.payload = SyncPayload(mcfg, cfg.inference.params_dtype, cfg.lora)
        self.replicas: ReplicaSet | None = None
        monitor = threading.Thread(target=self._monitor, name="weight-sync-monitor", daemon=True)
        monitor.start()
        self._await_first_weights()
        devices = split_roles(jax.devices(), cfg.async_.train_workers).host_devices(jax.process_index())
        with self.gate.lock:
            self.replicas = ReplicaSet(Model(mcfg), self.gate.params, cfg.inference, self.tokenizer, devices=devices,
                                       seed=cfg.seed, version=self.gate.version,
                                       name=f"inference{self.rank}", stop=self.envs.stop_sequences(),
                                       record_routes=cfg.moe.router_replay)
        if any(is_agent(s) for s in sources):
            from asyncrl.endpoint.host import HostAgents

            self.agents = HostAgents(self.replicas.engines[0], cfg.endpoint, cfg.agent, cfg.inference.group_size,
                                     self._agent_group, self._fail, grade=self._grade, tool_format=cfg.tools.format)
            self.agents.start()
        threads = [threading.Thread(target=self._push, args=(lane,), name=f"shipper-{'eval' if lane else 'train'}",
                                    daemon=True) for lane in (True, False)]
        threads += [threading.Thread(target=self._replica_loop, args=(e,), name=e.name, daemon=True)
                    for e in self.replicas.engines]
        for t in threads:
            t.start()
        log.info("inference %d serving with %d replicas", self.rank, len(self.replicas.engines))
        while not self.stop.is_set():
            time.sleep(0.2)
        if self.agents is not None:
            self.agents.close()
        self.verifier.close()
        self.envs.close()
        if self.errors:
            raise self.errors[0]
        return {}
