"""The inference host (`orchestration/inference_worker.py`) without Ray: its weight-sync gate (every replica parks
within one chunk, back-to-back syncs, a replica blocked in a hand-off), and the deadline and message of each of its
waits (parking, the first weights, a full rollout queue, an empty prompt queue)."""

import queue
import threading
import time
from types import SimpleNamespace

from asyncrl.orchestration.inference_worker import InferenceWorker
from asyncrl.orchestration.messages import WeightSync
from tests.helpers import FakeQueue, group, raises_within, wait_until


class Leaf:
    """A weight the monitor can free, as it frees jax arrays before new ones land."""

    def __init__(self, v):
        self.v, self.deleted = v, False

    def delete(self):
        self.deleted = True

    def __eq__(self, other):
        return isinstance(other, Leaf) and other.v == self.v


class FakeEngine:
    """Decodes in chunks (each `chunk_s` long) and calls the hook between them, like Engine._call."""

    def __init__(self, name, chunk_s):
        self.name, self.chunk_s = name, chunk_s
        self.version, self.params = 0, {"w": 0}
        self.model = SimpleNamespace(param_shardings=lambda mesh: None)
        self.mesh = None
        self.chunks_at: list[tuple[float, int]] = []

    def set_params(self, params, version):
        self.params, self.version = params, version


def _gate_worker(monkeypatch, engines, park_timeout_s, on_transfer=lambda: None):
    """An InferenceWorker over fake replicas, its monitor fed by an in-process queue; each sync's transfer calls
    `on_transfer` and lands a fresh Leaf (`landed` counts them)."""
    cfg = SimpleNamespace(async_=SimpleNamespace(queue_timeout_s=5, park_timeout_s=park_timeout_s),
                          eval_prompts=4, weightsync=SimpleNamespace(timeout_s=5))
    signals = FakeQueue(0)
    w = InferenceWorker(cfg, 1, "/tmp", {"weight_sync": signals})
    w.replicas = SimpleNamespace(engines=engines)
    landed = []

    class Transfer:
        def transfer(self, params, shapes, version=None):
            on_transfer()
            landed.append(time.perf_counter())
            return {"w": Leaf(len(landed))}, {}

    from asyncrl.models import preset
    from asyncrl.orchestration.payload import SyncPayload
    from asyncrl.train.config import LoraConfig

    w.transfer, w.payload = Transfer(), SyncPayload(preset("tiny"), "float32", LoraConfig())  # full fine-tune
    w.gate.params, w.gate.version = {"w": Leaf(0)}, 0
    return w, signals, landed


def _deadline_worker(**weightsync):
    cfg = SimpleNamespace(async_=SimpleNamespace(queue_timeout_s=5, park_timeout_s=0.1),
                          eval_prompts=4,
                          weightsync=SimpleNamespace(**{"timeout_s": 0.1, "first_sync_timeout_s": 0.3, **weightsync}))
    return InferenceWorker(cfg, 4, "/tmp", {})


def test_sync_gate_parks_every_replica_within_one_chunk(monkeypatch):
    engines = [FakeEngine("r0", 0.02), FakeEngine("r1", 0.05)]

    def no_replica_decoding():  # while the new weights land, no replica may be decoding
        assert all(e.busy is False for e in engines)

    w, signals, _ = _gate_worker(monkeypatch, engines, 5, no_replica_decoding)
    first = w.gate.params

    def replica(e):
        while not w.stop.is_set():
            w._maybe_update(e)
            e.busy = True
            time.sleep(e.chunk_s)  # one decode chunk
            e.busy = False
            e.chunks_at.append((time.perf_counter(), e.version))

    for e in engines:
        e.busy = False
    threads = [threading.Thread(target=replica, args=(e,), daemon=True) for e in engines]
    threads.append(threading.Thread(target=w._monitor, daemon=True))
    for t in threads:
        t.start()
    for v in (1, 2, 3):
        signals.put(WeightSync(v))
        assert wait_until(lambda v=v: all(e.version == v for e in engines)), [e.version for e in engines]
    w.stop.set()
    assert not w.errors, w.errors
    assert [e.params for e in engines] == [{"w": Leaf(3)}] * 2
    assert first["w"].deleted  # old weights freed before the new ones landed
    # Parking took at most one chunk of the slowest replica (plus scheduling slack), not a whole generation.
    assert w.sync_stats["park_s"] < 0.05 + 0.2


def test_sync_gate_names_the_park_timeout():
    cfg = SimpleNamespace(async_=SimpleNamespace(queue_timeout_s=5, park_timeout_s=0.2),
                          eval_prompts=4)
    qs = {"weight_sync": FakeQueue(2)}
    w = InferenceWorker(cfg, 3, "/tmp", qs)
    w.replicas = SimpleNamespace(engines=[FakeEngine("wedged", 0)])  # never calls the hook
    qs["weight_sync"].put(WeightSync(1))
    w._monitor()
    assert "inference3 monitor waited 0.2s (async.park_timeout_s) for 1 replicas to park for weight sync v1" \
        in str(w.errors[0])


def test_sync_gate_back_to_back_syncs_do_not_strand_a_parked_replica(monkeypatch):
    """Two syncs signalled at once (the trainer was waiting on the first, then signals the next at once): the
    monitor re-parks for the second right after releasing the first. A replica still in its park loop from the
    first must count for the second, not wait forever on a gate that is closed again (the CI chaos run that
    stalled 90 s at version 52 with every replica parked)."""
    engines = [FakeEngine("r0", 0.0), FakeEngine("r1", 0.0)]
    w, signals, landed = _gate_worker(monkeypatch, engines, 3)

    def replica(e):
        while not w.stop.is_set():
            w._maybe_update(e)
            time.sleep(0.001)

    threads = [threading.Thread(target=replica, args=(e,), daemon=True) for e in engines]
    threads.append(threading.Thread(target=w._monitor, daemon=True))
    for t in threads:
        t.start()
    last = 40
    for v in range(1, last + 1):  # every sync's signal already queued: the monitor re-parks at once
        signals.put(WeightSync(v))
    ok = wait_until(lambda: all(e.version == last for e in engines) or w.errors, timeout=20)
    w.stop.set()
    assert not w.errors, w.errors
    assert ok and [e.version for e in engines] == [last, last]
    assert len(landed) == last


def test_shipper_gives_up_on_a_full_rollout_queue_with_a_message():
    from asyncrl.orchestration.queues import QueueTimeout

    cfg = SimpleNamespace(async_=SimpleNamespace(queue_timeout_s=1.5, park_timeout_s=5),
                          eval_prompts=4,
                          task=SimpleNamespace(verifier=SimpleNamespace(timeout_s=1)))
    full = FakeQueue(1)
    full.put("someone else's group")
    w = InferenceWorker(cfg, 2, "/tmp", {"rollout": full})
    w.lanes[False].put(group(0, 0, [1, 0]))
    t0 = time.time()
    w._push(False)  # returns once it has recorded its error
    assert 1.5 <= time.time() - t0 < 10
    assert isinstance(w.errors[0], QueueTimeout)
    assert "inference2 shipper waited 2s (async.queue_timeout_s) to put a group on the full 'rollout' queue" \
        in str(w.errors[0])


def test_the_first_weights_wait_has_a_deadline_naming_its_field():
    w = _deadline_worker()
    e = raises_within(w._await_first_weights, 10)
    assert isinstance(e, TimeoutError) and "inference4 waited 0.3s (weightsync.first_sync_timeout_s) for its first " \
        "weights" in str(e)


def test_a_parked_replica_gives_up_on_a_sync_that_never_lands():
    w = _deadline_worker()
    w.gate.params, w.gate.version = {"w": 0}, 0
    w.gate.open()  # the monitor opened sync #1 and then wedged: it never releases it
    e = raises_within(lambda: w._maybe_update(FakeEngine("inference4/r0", 0)), 10)
    assert isinstance(e, TimeoutError) and "inference4/r0 of inference4 stayed parked 0.4s for weight sync #1" in str(e)


def test_a_replica_blocked_handing_off_a_group_still_parks_for_a_sync(monkeypatch):
    """A replica stuck handing a finished group to a full scoring lane (or a full verifier pool) parks for a weight
    sync between its tries: the sync waits a slice, not the whole hand-off (async.queue_timeout_s, up to 300 s)."""
    from concurrent.futures import Future

    engine = FakeEngine("r0", 0.0)
    w, signals, landed = _gate_worker(monkeypatch, [engine], park_timeout_s=2)
    w.cfg.task = SimpleNamespace(verifier=SimpleNamespace(submit_timeout_s=30))
    w.timeout_s = 30
    w.lanes[False] = queue.Queue(maxsize=1)
    w.lanes[False].put("a group nobody scores yet")  # the lane is full
    done = Future()
    done.set_result(SimpleNamespace(reward=1.0, reason="correct"))
    w.verifier = SimpleNamespace(submit=lambda text, sample, timeout=None: done)
    handoff = threading.Thread(target=w._on_group, args=(group(0, 0, [1, 0]), engine), daemon=True)
    handoff.start()
    threading.Thread(target=w._monitor, daemon=True).start()
    signals.put(WeightSync(1))
    assert wait_until(lambda: engine.version == 1, timeout=5), w.errors
    assert not w.errors and handoff.is_alive()  # the sync landed while the hand-off still waits
    w.lanes[False].get()  # the scorer takes a group: the hand-off completes
    handoff.join(5)
    assert not handoff.is_alive() and w.lanes[False].qsize() == 1
    w.stop.set()


def test_a_busy_replica_never_waits_on_an_empty_prompt_queue():
    """With rows in flight, an empty prompt queue must cost one non-blocking look, not the 50 ms poll an idle
    replica may block for: every decode call behind an empty queue paid it (`launch.py plan` found it: max_lag 0
    steps took 2.4 s instead of 0.6 s)."""
    cfg = SimpleNamespace(async_=SimpleNamespace(queue_timeout_s=1.5, park_timeout_s=5),
                          eval_prompts=4, inference=SimpleNamespace(max_prefill_prompts=4),
                          task=SimpleNamespace(verifier=SimpleNamespace(timeout_s=1)))
    w = InferenceWorker(cfg, 1, "/tmp", {"prompt": FakeQueue(8), "eval_prompt": FakeQueue(8)})
    t0 = time.perf_counter()
    for _ in range(20):
        assert w._next_requests(wait=False) == []
    assert time.perf_counter() - t0 < 0.2  # 20 blocking polls would take 1 s
    t0 = time.perf_counter()
    assert w._next_requests(wait=True) == []
    assert time.perf_counter() - t0 >= 0.04  # an idle replica waits a moment for a prompt

