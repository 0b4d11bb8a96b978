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

