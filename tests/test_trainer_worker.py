"""The trainer's side of the weight sync (`orchestration/trainer_worker.py`, weightsync.overlap): an overlapped
sync lets the trainer go on until the next one is due, a plain one blocks, and a failed one is raised."""

import threading
from types import SimpleNamespace

import pytest

from asyncrl.orchestration.trainer_worker import TrainerWorker
from asyncrl.weightsync.config import WeightSyncConfig


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



def test_measured_staleness_is_logged_by_lag_and_drives_adaptive_admission():
    """The step's per-group weight sums (`Trainer.group_weights`, by global group id) -> the row's ESS by lag, and
    the release lag the feeder reads: grown while the stalest groups keep their ESS, shrunk once they lose it."""
    import numpy as np

    from asyncrl.orchestration.staleness import Admission, Staleness
    from tests.helpers import group

    tw = TrainerWorker.__new__(TrainerWorker)
    tw.cfg = SimpleNamespace(async_=SimpleNamespace(max_lag=2))
    tw.staleness = Staleness(2, Admission(2, ess_target=0.9, ess_floor=0.5))
    # Two groups of two rows (ids 0 and 1; 4 rows, so ids 2..3 are empty). Group 0: w = [1, 1] (ESS 1);
    # group 1: w = [3, 1] over 2 tokens, ESS 16 / (2 x 10) = 0.8, k3 = (3 - 1 - log 3) / 2.
    sums = np.array([[2.0, 2.0, 2.0, 0.0], [4.0, 10.0, 2.0, 2.0 - np.log(3.0)], [0, 0, 0, 0], [0, 0, 0, 0]])
    tw.trainer = SimpleNamespace(group_weights=sums, group_offset=lambda rows: 0, combine_host_metrics=lambda m: m)
    rollouts = [group(0, 5, [0, 1]), group(1, 4, [1, 0])]  # trained on version 5: lags 0 and 1
    row = tw._measure_staleness(6, 5, rollouts, 4)
    assert row["staleness/ess_lag0"] == 1.0 and row["staleness/ess_lag1"] == 0.8
    assert row["staleness/groups_lag1"] == 1.0 and row["staleness/groups_lag2"] == 0.0
    assert row["staleness/ess_mean"] == 0.9 and row["staleness/ess_min"] == 0.8
    assert abs(row["staleness/k3_mean"] - (2.0 - np.log(3.0)) / 4) < 1e-12
    assert abs(row["staleness/batch_ess"] - 36 / (4 * 12)) < 1e-12
    assert row["admission/ahead"] == 0.0  # the stalest (lag 1) measured 0.8 < 0.9: stays on-policy
    sums[1] = [4.0, 8.0, 2.0, 0.0]  # lag 1 now ESS 1
    assert tw._measure_staleness(7, 5, rollouts, 4)["admission/ahead"] == 1.0
