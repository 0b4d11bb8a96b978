"""The async core without Ray: the prompt feeder's gate, drop credit and resume positions, the collector's
callbacks, evals kept at the final step, and the inference host's weight-sync gate, all on in-process queues."""

import queue
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from asyncrl.orchestration.collect import RolloutTimeout, collect_rollouts
from asyncrl.orchestration.evals import Evals
from asyncrl.orchestration.feeder import Feeder, FeederError
from asyncrl.orchestration.inference_worker import InferenceWorker
from asyncrl.orchestration.messages import GroupConsumed, WeightSync
from asyncrl.orchestration.staleness import Staleness, StragglerWait
from asyncrl.orchestration.trainer_worker import TrainerWorker
from asyncrl.rollout import Completion, Prompt, Rollout
from asyncrl.weightsync.config import WeightSyncConfig


class FakeQueue:
    """The RoleQueue interface over a bounded queue.Queue."""

    def __init__(self, maxsize: int = 0):
        self.q = queue.Queue(maxsize)

    def put(self, item, timeout=None):
        try:
            self.q.put(item, timeout=timeout)
        except queue.Full:
            raise TimeoutError("full") from None

    def poll(self, timeout):
        try:
            return self.q.get(timeout=timeout)
        except queue.Empty:
            return None

    def get_nowait(self):
        return self.q.get_nowait()

    def drain(self):
        out = []
        while True:
            try:
                out.append(self.q.get_nowait())
            except queue.Empty:
                return out

    def qsize(self):
        return self.q.qsize()

    def as_role(self, role, timeout=None):
        return self


def sample_stream():
    i = 0
    while True:
        yield SimpleNamespace(id=f"s{i}", prompt=f"p{i}", answer=str(i))
        i += 1


def group(position, version, rewards, round_=-1):
    comps = [Completion(tokens=np.array([1, 2], np.int32), logprobs=np.zeros(2, np.float32), forced=np.zeros(2, bool),
                        versions=np.full(2, version, np.int32), reward=float(r)) for r in rewards]
    return Rollout(prompt=Prompt(position, SimpleNamespace(id=f"s{position}", answer=str(position)), len(rewards),
                                 round_), prompt_tokens=np.array([3], np.int32), completions=comps)


def wait_until(pred, timeout=5.0):
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return True
        time.sleep(0.005)
    return pred()


def make_feeder(P=4, max_lag=1, maxsize=1000, **kw):
    q = FakeQueue(maxsize)
    f = Feeder(sample_stream, q.put, prompts_per_step=P, staleness=Staleness(max_lag), group_size=2, poll_s=0.001,
               **kw)
    return f, q


def released(q):
    return [item.position for item in q.drain()]


# ---- the gate --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("max_lag", [0, 1, 2])
def test_feeder_releases_exactly_max_lag_steps_ahead(max_lag):
    P = 4
    f, q = make_feeder(P, max_lag)
    f.set_synced(0)  # the initial sync: inference holds version 0
    f.start()
    # Step s trains on version s-1 and accepts version >= s-1-max_lag: with v=0 synced, steps 1..max_lag+1.
    assert wait_until(lambda: q.qsize() == P * (max_lag + 1))
    time.sleep(0.05)
    assert released(q) == list(range(P * (max_lag + 1)))  # and not one more (no step of slack)
    f.set_synced(1)
    assert wait_until(lambda: q.qsize() == P)
    time.sleep(0.05)
    assert released(q) == list(range(P * (max_lag + 1), P * (max_lag + 2)))
    f.stop.set()


def test_a_drop_releases_a_replacement_at_once():
    f, q = make_feeder(P=4, max_lag=0)
    f.set_synced(0)
    f.start()
    assert wait_until(lambda: q.qsize() == 4)
    time.sleep(0.02)
    assert released(q) == [0, 1, 2, 3]
    f.consumed(1, "zero_variance")  # before the step: the trainer is short one group
    assert wait_until(lambda: q.qsize() == 1)
    assert released(q) == [4]
    f.consumed(0, None)  # a kept group frees nothing until the weights move on
    time.sleep(0.05)
    assert q.qsize() == 0
    # The share: 0.05 toward 1 (a zero-variance drop), then 0.05 toward 0 (a kept group).
    assert f.state() == {"position": 5, "dropped": 1, "in_flight": [2, 3, 4], "zero_variance_share": 0.0475}
    with pytest.raises(ValueError, match="position 0 was never released or was already consumed"):
        f.consumed(0, None)
    f.stop.set()


def test_remote_ranks_credit_through_the_drain():
    reports = []  # what trainer ranks > 0 put on the 'consumed' queue
    f, q = make_feeder(P=2, max_lag=0, drain_remote=lambda: [reports.pop(0) for _ in range(len(reports))])
    f.set_synced(0)
    f.start()
    assert wait_until(lambda: q.qsize() == 2)
    reports.append(GroupConsumed(1, "lag", 1))  # rank 1 dropped the group of position 1
    assert wait_until(lambda: q.qsize() == 3)  # the feeder drains while it waits, and replaces it
    assert released(q) == [0, 1, 2]
    assert f.state() == {"position": 3, "dropped": 1, "in_flight": [0, 2], "zero_variance_share": 0.0}
    f.stop.set()


def test_feeder_error_surfaces_with_its_traceback_instead_of_a_timeout():
    def broken():
        yield SimpleNamespace(id="ok")
        raise KeyError("dataset row 1 has no 'question' field")

    q = FakeQueue()
    f = Feeder(broken, q.put, prompts_per_step=4, staleness=Staleness(0), group_size=1, poll_s=0.001)
    f.set_synced(0)
    f.start()
    rq = FakeQueue()
    t0 = time.time()
    with pytest.raises(FeederError, match=r"(?s)no 'question' field.*Traceback.*in broken"):
        collect_rollouts(rq.poll, 4, 0, Staleness(0), timeout_s=60, check=f.check, poll_s=0.05)
    assert time.time() - t0 < 10  # not the 60 s rollout timeout
    with pytest.raises(RolloutTimeout):  # without a feeder error the timeout is still there
        collect_rollouts(rq.poll, 1, 0, Staleness(0), timeout_s=0.1, poll_s=0.02)


def test_feeder_put_gives_up_with_a_message():
    q = FakeQueue(maxsize=1)
    f = Feeder(sample_stream, q.put, prompts_per_step=4, staleness=Staleness(0), group_size=1, poll_s=0.001,
               timeout_s=1.5)
    f.set_synced(0)
    f.start()
    assert wait_until(lambda: f.error is not None, timeout=10)
    with pytest.raises(FeederError, match="waited 2s to put the prompt at data position 1 on the full 'prompt' queue"):
        f.check()


# ---- a simulated loop: feeder -> fake inference -> collector ---------------------------------------------------

class Sim:
    """Feeder, one fake inference thread and the collector, with the trainer's step order (collect, step, sync).
    Inference samples a prompt at the version it holds when it takes it; `rewards(position)` scores its group."""

    def __init__(self, P, max_lag, rewards, drop_zero_variance=False, decode_s=0.0, step_s=0.0, state=None, version=0,
                 replicas=1, pooled=True, oversample=False):
        self.P, self.max_lag, self.rewards, self.zv = P, max_lag, rewards, drop_zero_variance
        self.prompts, self.rollouts = FakeQueue(5 * P), FakeQueue(10 * P)
        self.feeder = Feeder(sample_stream, self.prompts.put, prompts_per_step=P, staleness=Staleness(max_lag),
                             group_size=2, poll_s=0.001, oversample=oversample)
        if state:
            self.feeder.restore(state)
        self.version = version  # a resumed run starts at its checkpoint's version
        self.inference_version = version
        self.decode_s, self.step_s, self.replicas, self.pooled = decode_s, step_s, replicas, pooled
        self.order: list[int] = []  # positions in the order the collector saw them
        self.wrong_sample: list[int] = []
        self.taken: list[tuple[int, int]] = []  # (step, position) of every trained group
        self.dropped: list[tuple[int, int, str]] = []
        self.stop = threading.Event()

    def _inference(self):
        while not self.stop.is_set():
            item = self.prompts.poll(0.01)
            if item is None:
                continue
            v = self.inference_version
            time.sleep(self.decode_s(item.position) if callable(self.decode_s) else self.decode_s)
            r = group(item.position, v, self.rewards(item.position))
            r.sample = (item.position, -1, item.sample)
            self.rollouts.put(r, timeout=5)

    def run(self, steps, straggler=float("inf")):
        for _ in range(self.replicas):
            threading.Thread(target=self._inference, daemon=True).start()
        pool = [] if self.pooled else None
        urgent = self.feeder.urgent if self.pooled else None
        self.feeder.set_synced(self.version)
        self.feeder.start()
        metrics = []
        try:
            for step in range(1, steps + 1):
                def on(r, reason, step=step):
                    self.feeder.consumed(r.prompt.position, reason)
                    self.order.append(r.prompt.position)
                    if r.prompt.id != f"s{r.prompt.position}":
                        self.wrong_sample.append(r.prompt.position)
                    (self.dropped.append((step, r.prompt.position, reason)) if reason else None)
                kept, m = collect_rollouts(self.rollouts.poll, self.P, self.version, Staleness(self.max_lag), self.zv,
                                           timeout_s=5, on_consumed=on, check=self.feeder.check, poll_s=0.05,
                                           pool=pool, urgent=urgent, straggler=straggler)
                self.taken += [(step, r.prompt.position) for r in kept]
                metrics.append(m)
                time.sleep(self.step_s)
                self.version += 1  # the step
                self.inference_version = self.version  # the sync
                self.feeder.set_synced(self.version)
        finally:
            self.stop.set()
            self.feeder.stop.set()
        return metrics


@pytest.mark.parametrize("max_lag", [1, 2])
def test_fast_inference_drops_nothing_for_lag(max_lag):
    # Inference is much faster than the trainer (the case where a step of slack made groups too stale).
    sim = Sim(P=4, max_lag=max_lag, rewards=lambda p: [p % 2, 1 - p % 2], step_s=0.05)
    metrics = sim.run(12)
    assert sum(m["rollout/filtered_lag"] for m in metrics) == 0
    assert max(m["rollout/lag_max"] for m in metrics) <= max_lag
    assert max(m["rollout/lag_max"] for m in metrics) == max_lag  # inference does run max_lag steps ahead
    positions = [p for _, p in sim.taken]
    assert len(positions) == len(set(positions)) == 48


@pytest.mark.parametrize("pooled", [True, False])
def test_out_of_order_groups_are_trained_oldest_first(pooled):
    """Four replicas, every third group slow: without the pool a step takes the next step's quick groups and its
    own stragglers come back too stale; with it (oldest first, waiting for urgent positions) nothing is lost."""
    sim = Sim(P=8, max_lag=1, rewards=lambda p: [p % 2, 1 - p % 2], replicas=4, step_s=0.01,
              decode_s=lambda p: 0.06 if p % 3 == 0 else 0.002, pooled=pooled)
    metrics = sim.run(10)
    lag_drops = sum(m["rollout/filtered_lag"] for m in metrics)
    if pooled:
        assert lag_drops == 0
        assert max(m["rollout/lag_max"] for m in metrics) <= 1
    else:
        assert lag_drops > 0  # the case the pool exists for (so the test above is not vacuous)
    positions = [p for _, p in sim.taken]
    assert len(positions) == len(set(positions)) == 80


@pytest.mark.parametrize("max_lag", [0, 1])
def test_zero_variance_filter_never_starves_the_trainer(max_lag):
    # 3 of every 4 groups are all-correct: DAPO's filter drops them, the credit replaces them at once.
    sim = Sim(P=4, max_lag=max_lag, rewards=lambda p: [1, 1] if p % 4 else [1, 0], drop_zero_variance=True)
    metrics = sim.run(5)
    assert sum(m["rollout/filtered_zero_variance"] for m in metrics) >= 3 * 20 - 4 * (max_lag + 1)
    assert all(p % 4 == 0 for _, p in sim.taken) and len(sim.taken) == 20
    if max_lag == 0:  # on-policy and deterministic: exactly the first 20 groups with variance, in order
        assert [p for _, p in sim.taken] == [4 * i for i in range(20)]


def test_oversampling_front_loads_the_expected_replacements():
    f, q = make_feeder(P=4, max_lag=0, oversample=True)
    f.set_synced(0)
    f.start()
    assert wait_until(lambda: q.qsize() == 4)  # no estimate yet: P
    for p in range(3):
        f.consumed(p, "zero_variance")  # the share estimate rises ...
    f.consumed(3, None)
    assert wait_until(lambda: f.state()["position"] >= 7)
    for p in range(4, 7):
        f.consumed(p, "zero_variance")
    share = f.zero_variance_share
    assert 0.2 < share < 0.4
    expected = 4 + 6 + int(np.ceil(4 * share / (1 - share)))  # P + credited drops + oversampling
    assert wait_until(lambda: f.state()["position"] == expected)
    time.sleep(0.05)
    assert f.state()["position"] == expected
    for p in range(7, 10):
        f.consumed(p, "lag")  # lag drops are credited but do not move the estimate
    assert f.zero_variance_share == share
    f.stop.set()


@pytest.mark.parametrize("max_lag", [0, 1])
def test_oversampled_dapo_steps_train_only_groups_with_variance(max_lag):
    sim = Sim(P=4, max_lag=max_lag, rewards=lambda p: [1, 1] if p % 4 else [1, 0], drop_zero_variance=True,
              oversample=True, decode_s=0.002)
    metrics = sim.run(6)
    assert all(p % 4 == 0 for _, p in sim.taken) and len(sim.taken) == 24
    assert sim.feeder.zero_variance_share > 0.5
    assert max(m["rollout/lag_max"] for m in metrics) <= max_lag


def test_resume_regenerates_in_flight_prompts_and_skips_nothing():
    rewards = lambda p: [p % 2, 1 - p % 2] if p % 5 else [0, 0]  # noqa: E731  (every 5th group dropped)
    first = Sim(P=4, max_lag=2, rewards=rewards, drop_zero_variance=True, decode_s=0.001)
    first.run(6)
    state = first.feeder.state()
    assert state["in_flight"], "max_lag=2 keeps prompts in flight at the checkpoint"
    consumed = {p for _, p in first.taken} | {p for _, p, _ in first.dropped}
    assert set(range(state["position"])) == consumed | set(state["in_flight"])  # every released position accounted
    second = Sim(P=4, max_lag=2, rewards=rewards, drop_zero_variance=True, state=state, version=first.version)
    second.run(6)
    # The in-flight prompts come first, each with its own sample (and so its own per-position seeds).
    assert second.order[:len(state["in_flight"])] == state["in_flight"]
    assert not first.wrong_sample and not second.wrong_sample
    trained = [p for _, p in first.taken] + [p for _, p in second.taken]
    dropped = [p for _, p, _ in first.dropped] + [p for _, p, _ in second.dropped]
    assert len(trained) == len(set(trained)) == 48  # nothing trained twice
    assert not set(trained) & set(dropped)
    top = max(trained)
    assert set(range(top + 1)) <= set(trained) | set(dropped) | second.feeder.in_flight  # nothing skipped
    assert all(p % 5 == 0 for p in dropped)


def test_restore_rejects_inconsistent_meta():
    f, _ = make_feeder()
    with pytest.raises(ValueError, match="in-flight positions .* must be below position 3"):
        f.restore({"position": 3, "dropped": 0, "in_flight": [1, 5]})
    f.restore({"position": 7, "dropped": 2})  # a checkpoint from before in-flight tracking
    assert f.state() == {"position": 7, "dropped": 2, "in_flight": [], "zero_variance_share": 0.0}


# ---- evals ------------------------------------------------------------------------------------------------------

def test_eval_pending_at_the_final_step_is_kept(tmp_path):
    prompts, results = FakeQueue(100), FakeQueue(100)
    ev = Evals(sample_stream, num_prompts=3, group_size=2, run_dir=str(tmp_path), put=prompts.put,
               poll=results.poll, qsize=results.qsize, timeout_s=5)
    stop = threading.Event()

    def serve():  # a fake inference host: version = round, reward 1 for even positions
        while not stop.is_set():
            item = prompts.poll(0.01)
            if item is not None:
                r = float(item.position % 2 == 0)
                results.put(group(item.position, item.eval_round, [r, r], item.eval_round))

    class Sync:  # the weight sync of the step, still in flight (weightsync.overlap)
        def __init__(self):
            self.pending_when_done = "never waited"

        def wait(self, timeout_s, who):
            self.pending_when_done = ev.pending  # the eval round out when the sync landed
            return {"weight_sync_s": 0.5}

    tw = TrainerWorker.__new__(TrainerWorker)  # the trainer's hook that holds a launch until the sync landed
    tw._sync, tw._sync_m, tw._eval_blocked_s, tw.rank = None, {}, 0.0, 0
    tw.cfg = SimpleNamespace(weightsync=WeightSyncConfig())
    ev.launch(0, 0)
    t = threading.Thread(target=serve, daemon=True)
    assert ev.at_step(1, 4, every=2) == {}  # round 0 not back yet (nothing serves): nothing to record
    t.start()
    assert wait_until(ev.ready)
    tw._sync = sync = Sync()
    row2 = ev.at_step(2, 4, every=2, before_launch=tw._await_sync_for_eval)  # collects round 0, launches round 2
    assert row2["eval/at_step"] == 0 and ev.pending[0] == 2
    # Round 2 went out only once step 2's weights had landed: an eval at step k runs with the weights of step k.
    assert sync.pending_when_done is None and tw._sync is None and tw._sync_m == {"weight_sync_s": 0.5}
    row4 = ev.at_step(4, 4, every=2)  # final step: round 2 is still pending -> waited for and recorded
    stop.set()
    assert row4["eval/at_step"] == 4 and row4["eval/prompts"] == 3
    rows = [__import__("json").loads(x) for x in open(tmp_path / "evals.jsonl")]
    assert [r["round"] for r in rows] == [0, 2, 4]
    assert rows[1]["eval/reward_mean"] == pytest.approx(2 / 3)  # positions 1e9, 1e9+1, 1e9+2: two even
    assert ev.pending is None


# ---- the inference host's sync gate -----------------------------------------------------------------------------

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


def test_shipper_gives_up_on_a_full_rollout_queue_with_a_message():
    from asyncrl.orchestration.queues import QueueTimeout

    cfg = SimpleNamespace(async_=SimpleNamespace(queue_timeout_s=1.5, park_timeout_s=5),
                          eval_prompts=4, task=SimpleNamespace(verifier=SimpleNamespace(timeout_s=1)))
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


def test_zero_variance_budget_fills_the_step_instead_of_sampling_forever():
    stream = [group(p, 0, [1, 1]) for p in range(7)] + [group(7, 0, [1, 0])]
    stream += [group(p, 0, [0, 0]) for p in range(8, 12)]
    q = FakeQueue()
    for r in stream:
        q.put(r)
    seen = []
    kept, m = collect_rollouts(q.poll, 4, 0, Staleness(0), drop_zero_variance=True, timeout_s=1, poll_s=0.05,
                               on_consumed=lambda r, reason: seen.append((r.prompt.position, reason)),
                               zero_variance_budget=5)
    # 5 dropped, then zero-variance groups fill the batch next to the one group with variance.
    assert m["rollout/filtered_zero_variance"] == 5 and m["rollout/zero_variance_fillers"] == 3
    assert [r.prompt.position for r in kept] == [5, 6, 7, 8]
    assert seen == [(p, "zero_variance") for p in range(5)] + [(p, None) for p in (5, 6, 7, 8)]
    import jax.numpy as jnp

    from asyncrl.train.advantages import keep_sequences
    from asyncrl.train.loss_config import LossConfig

    rewards = jnp.asarray([c.reward for r in kept for c in r.completions])
    ids = jnp.asarray([g for g, r in enumerate(kept) for _ in r.completions])
    keep = keep_sequences(rewards, ids, LossConfig(name="dapo", filter_zero_variance=True))
    assert keep.tolist() == [False] * 4 + [True] * 2 + [False] * 2  # the loss gives the fillers no weight


def test_straggler_wait_is_bounded():
    q = FakeQueue()
    for p in range(4):
        q.put(group(p, 1, [1, 0]))  # lag 0: fresher groups could still come, so the step may wait
    t0 = time.time()
    kept, m = collect_rollouts(q.poll, 3, 1, Staleness(1), timeout_s=30, poll_s=0.05, pool=(pool := []),
                               urgent=lambda v: {99}, straggler=0.3)  # 99 never comes
    assert 0.25 < time.time() - t0 < 5
    assert len(kept) == 3 and len(pool) == 1  # the 4th group is carried to the next step
    kept, m = collect_rollouts(q.poll, 1, 1, Staleness(1), timeout_s=30, poll_s=0.05, pool=pool,
                               urgent=lambda v: set())
    assert [r.prompt.position for r in kept] == [3] and not pool


# ---- the trainer's side of the weight sync (weightsync.overlap) -------------------------------------------------

def _sync_worker(overlap: bool):
    from asyncrl.weightsync.transfer import PendingSync

    class Transfer:  # the hop chain's interface; each sync holds until the test releases it
        def __init__(self):
            self.releases, self.sent = [], []

        def start(self, tree, on_done, version=None):
            release = threading.Event()
            self.releases.append(release)
            self.sent.append(tree)

            def target():
                assert release.wait(10), "never released"
                on_done()
                return {"weight_sync_s": 1.0 + len(self.sent)}
            return PendingSync(target, f"sync-{len(self.sent)}")

    synced = []
    tw = TrainerWorker.__new__(TrainerWorker)
    tw.cfg = SimpleNamespace(weightsync=WeightSyncConfig(overlap=overlap))
    tw.rank, tw.run_dir, tw.inference_hosts, tw.infer_dtype = 1, "", 1, None  # rank 1: no queue signals to send
    tw.trainer = SimpleNamespace(version=0, step_count=0,
                                 sync_payload=lambda dtype, full: f"copy of v{tw.trainer.version}")
    tw.feeder = SimpleNamespace(set_synced=synced.append)
    tw.transfer, tw._sync, tw._sync_m, tw._synced = Transfer(), None, {}, 0
    return tw, synced


def test_overlapped_sync_lets_the_trainer_go_on_until_the_next_sync_is_due():
    tw, synced = _sync_worker(overlap=True)
    m = tw.sync_weights()  # returns with the chain still running: the trainer's next step starts at once
    assert tw.transfer.sent == ["copy of v0"] and synced == [] and set(m) == {"weight_sync/trainer_blocked_s"}
    tw.trainer.version = 1
    out = {}
    second = threading.Thread(target=lambda: out.update(tw.sync_weights()))
    second.start()  # the next sync is due before the first landed: it waits for it (the double buffer's bound)
    second.join(0.3)
    assert second.is_alive() and tw.transfer.sent == ["copy of v0"]
    tw.transfer.releases[0].set()
    second.join(5)
    assert not second.is_alive()
    assert synced == [0] and tw.transfer.sent == ["copy of v0", "copy of v1"]
    assert out["weight_sync_s"] == 2.0  # the row carries the last finished sync's timings ...
    assert out["weight_sync/trainer_blocked_s"] >= 0.3  # ... and the time this call really held the trainer
    tw.transfer.releases[1].set()
    assert tw._await_sync() >= 0 and synced == [0, 1] and tw._sync is None


def test_sync_without_overlap_blocks_until_the_weights_landed():
    tw, synced = _sync_worker(overlap=False)
    done = threading.Event()
    t = threading.Thread(target=lambda: (tw.sync_weights(), done.set()))
    t.start()
    assert not done.wait(0.3)  # held while the chain runs
    tw.transfer.releases[0].set()
    assert done.wait(5) and synced == [0]


def test_a_failed_sync_is_raised_on_the_trainer():
    tw, _ = _sync_worker(overlap=True)

    def broken(tree, on_done, version=None):
        from asyncrl.weightsync.transfer import PendingSync

        def target():
            raise RuntimeError("weight sync #3: hop 1 (slot 1 -> slot 2) failed on bucket 2/5")
        return PendingSync(target, "sync")
    tw.transfer.start = broken
    tw.sync_weights()
    with pytest.raises(RuntimeError, match="hop 1 .* bucket 2/5"):
        tw.sync_weights()


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


def test_a_stalled_verifier_fails_the_step_naming_the_sample():
    """The single-turn environment waits a bounded time for its grade; a stalled pool fails that step (the engine
    then ends the episode with reward 0 and a reason) with an error naming the sample and the setting."""
    from asyncrl.envs.single_turn import SingleTurnEnv
    from asyncrl.rollout import Turn

    class Stuck:  # a verifier future that never resolves within the wait
        def result(self, timeout):
            raise TimeoutError

    env = SingleTurnEnv([1, 2], SimpleNamespace(id="gsm8k/7"), SimpleNamespace(submit=lambda text, s: Stuck()), 38)
    with pytest.raises(TimeoutError, match=r"no score for gsm8k/7 within 38s \(4 x task.verifier.timeout_s \+ 30\)"):
        env.step(Turn(np.array([3]), "3", 0, "eos", True))


def test_a_wedged_weight_sync_names_the_waiting_trainer():
    from asyncrl.weightsync.transfer import PendingSync

    release = threading.Event()
    pending = PendingSync(lambda: (release.wait(5), {})[1], "weight-sync-3")
    with pytest.raises(TimeoutError, match=r"trainer0 waited 0.1s for its weight sync \(weight-sync-3, the hop chain"):
        pending.wait(0.1, "trainer0")
    release.set()
    assert pending.wait(5) == {}


def test_drop_warnings_are_rate_limited(monkeypatch, caplog):
    import logging

    import asyncrl.orchestration.collect as collect_mod

    monkeypatch.setattr(collect_mod, "_last_drop_warning", [float("-inf")])
    with caplog.at_level(logging.WARNING, logger="asyncrl.orchestration.collect"):
        for step in range(3):  # three steps, each dropping 15 too-stale groups before taking 1 fresh one
            q = FakeQueue()
            for p in range(15):
                q.put(group(100 * step + p, 0, [0.0, 1.0]))
            q.put(group(100 * step + 99, 5, [0.0, 1.0]))
            got, m = collect_rollouts(q.poll, 1, 5, Staleness(1), timeout_s=5, poll_s=0.01)
            assert m["rollout/filtered_lag"] == 15 and len(got) == 1
    said = [r.getMessage() for r in caplog.records if "groups so far" in r.getMessage()]
    assert len(said) == 1 and "dropped 10 groups so far for version 5" in said[0], said


def test_the_zero_variance_share_survives_a_checkpoint():
    """DAPO's oversampling estimate is part of the feeder's checkpointed state: a resumed run oversamples at once,
    instead of restarting cold from P prompts a step."""
    f, _ = make_feeder(P=4, max_lag=0, oversample=True)
    f.set_synced(0)
    f.start()
    assert wait_until(lambda: f.state()["position"] == 4)
    for p in range(3):
        f.consumed(p, "zero_variance")
    f.stop.set()
    share = f.zero_variance_share
    assert share > 0
    g, _ = make_feeder(P=4, max_lag=0, oversample=True)
    g.restore(f.state())
    assert g.zero_variance_share == share
    g.set_synced(0)
    assert g.allowed() == 4 + 3 + g.oversample_for(4) and g.oversample_for(4) >= 1


def test_a_checkpoint_snapshot_sees_a_report_another_thread_is_applying():
    """Rank 0's feeder thread and trainer thread both drain the other trainer ranks' reports. If the feeder thread
    has popped a report (position 1, trained by rank 1) but not applied it yet, the trainer's drain-then-snapshot for
    a checkpoint must still see it applied: listing position 1 in flight would make a resume train it twice."""
    reports = []
    f, q = make_feeder(P=2, max_lag=0, drain_remote=lambda: [reports.pop(0) for _ in range(len(reports))])
    f.set_synced(0)
    f.start()
    assert wait_until(lambda: q.qsize() == 2)
    f.stop.set()
    f._thread.join(5)
    applying, release = threading.Event(), threading.Event()
    consumed = f.consumed

    def slow_consumed(position, reason):  # the feeder thread, between popping a report and applying it
        applying.set()
        assert release.wait(5)
        consumed(position, reason)

    f.consumed = slow_consumed
    reports.append(GroupConsumed(1, None, 1))
    drainer = threading.Thread(target=f.drain_remote)
    drainer.start()
    assert applying.wait(5) and not reports  # popped, not yet applied
    threading.Timer(0.3, release.set).start()
    f.consumed = consumed  # the trainer thread's own drain applies nothing slowly
    f.drain_remote()  # rank 0 drains before it snapshots (`TrainerWorker._feeder_state`)
    snapshot = f.state()
    drainer.join(5)
    assert snapshot["in_flight"] == [0], snapshot


# ---- every wait has a deadline of its own (also with run.stall_timeout_s=0) --------------------------------------


def _deadline_worker(**weightsync):
    cfg = SimpleNamespace(async_=SimpleNamespace(queue_timeout_s=5, park_timeout_s=0.1),
                          eval_prompts=4,
                          weightsync=SimpleNamespace(**{"timeout_s": 0.1, "first_sync_timeout_s": 0.3, **weightsync}))
    return InferenceWorker(cfg, 4, "/tmp", {})


def _raises_within(fn, seconds):
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("e", _capture(fn)), daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still waiting after {seconds}s"
    return box["e"]


def _capture(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return e
    return None


def test_the_first_weights_wait_has_a_deadline_naming_its_field():
    w = _deadline_worker()
    e = _raises_within(w._await_first_weights, 10)
    assert isinstance(e, TimeoutError) and "inference4 waited 0.3s (weightsync.first_sync_timeout_s) for its first " \
        "weights" in str(e)


def test_a_parked_replica_gives_up_on_a_sync_that_never_lands():
    w = _deadline_worker()
    w.gate.params, w.gate.version = {"w": 0}, 0
    w.gate.open()  # the monitor opened sync #1 and then wedged: it never releases it
    e = _raises_within(lambda: w._maybe_update(FakeEngine("inference4/r0", 0)), 10)
    assert isinstance(e, TimeoutError) and "inference4/r0 of inference4 stayed parked 0.4s for weight sync #1" in str(e)


def test_a_hop_receive_whose_sender_died_times_out_naming_the_bucket():
    from asyncrl.weightsync.transfer import HopChainTransfer

    class NeverArrives:
        def block_until_ready(self):
            time.sleep(3600)

    hc = HopChainTransfer.__new__(HopChainTransfer)
    hc.timeout_s, hc.on_event = 0.2, None
    e = _raises_within(lambda: hc._wait([NeverArrives()], "weight sync v7", 0, 1, 3), 10)
    assert isinstance(e, TimeoutError) and "weight sync v7: hop 0 (slot 0 -> slot 1" in str(e) \
        and "bucket 2/3 did not arrive within 0.2s (weightsync.timeout_s)" in str(e)


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


# ---- the adaptive straggler wait ----------------------------------------------------------------------------------


def test_the_straggler_wait_doubles_after_a_miss_and_shrinks_toward_what_it_needed():
    w = StragglerWait(floor_s=0.5, cap_s=4.0)
    w.note_busy(10.0)  # long steps: waiting up to the cap is within the trainer's busy time
    w.observe([], gave_up=True)
    assert w.current_s == 1.0
    for _ in range(5):
        w.observe([], gave_up=True)
    assert w.current_s == 4.0  # capped
    w.observe([1.5], gave_up=False)  # the stragglers came, the slowest 1.5 s after the step was full
    assert w.current_s == pytest.approx(3.6)  # 10% shorter, still above twice 1.5 s
    for _ in range(50):
        w.observe([0.05], gave_up=False)
    assert w.current_s == 0.5  # back to the floor once they come quickly
    # Short steps: the trainer never idles for stragglers longer than it works (a slow host's groups are dropped).
    short = StragglerWait(floor_s=0.5, cap_s=8.0)
    short.note_busy(0.3)
    for _ in range(5):
        short.observe([], gave_up=True)
    assert short.current_s == 0.5
    for _ in range(10):
        short.note_busy(1.2)
    short.observe([], gave_up=True)
    assert 0.5 < short.current_s <= 1.2
    fixed = StragglerWait(0.5, 4.0, adaptive=False)
    fixed.observe([], gave_up=True)
    assert fixed.current_s == 0.5


@pytest.mark.parametrize("adaptive", [False, True])
def test_slow_stragglers_are_dropped_by_a_fixed_wait_and_caught_by_an_adaptive_one(adaptive):
    """Steps that work 0.6 s, and one group a step that takes 1.2 s to generate: a fixed 0.2 s wait drops nearly
    all of them for lag (11 of 10 steps' worth here, replacements included); the adaptive one grows, within the 0.6 s
    the trainer works, and catches them (2 drops here)."""
    sim = Sim(P=4, max_lag=1, rewards=lambda p: [p % 2, 1 - p % 2], replicas=4, step_s=0.6,
              decode_s=lambda p: 1.2 if p % 4 == 3 else 0.01)
    wait = StragglerWait(0.2, 4.0, adaptive=adaptive)
    wait.note_busy(0.6)
    metrics = sim.run(10, straggler=wait)
    drops = sum(m["rollout/filtered_lag"] for m in metrics)
    if adaptive:
        assert drops <= 4, drops
        assert 0.2 < wait.current_s <= 0.6
    else:
        assert drops >= 6, drops
    assert max(m["rollout/lag_max"] for m in metrics) <= 1


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
