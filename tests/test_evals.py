"""Evals (`orchestration/evals.py`): a round pending at the final step is waited for and kept, and a round is
launched only once the step's weights have landed."""

import json
import threading
from types import SimpleNamespace

import pytest

from asyncrl.orchestration.evals import Evals
from asyncrl.orchestration.trainer_worker import TrainerWorker
from asyncrl.weightsync.config import WeightSyncConfig
from tests.helpers import FakeQueue, group, sample_stream, wait_until


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
    rows = [json.loads(x) for x in open(tmp_path / "evals.jsonl")]
    assert [r["round"] for r in rows] == [0, 2, 4]
    assert rows[1]["eval/reward_mean"] == pytest.approx(2 / 3)  # positions 1e9, 1e9+1, 1e9+2: two even
    assert ev.pending is None

