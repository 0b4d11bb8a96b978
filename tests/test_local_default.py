"""The embedded local default, in its real configuration: held-out eval reward must rise by a wide margin."""

import json
import os
import time

import pytest

from tests.helpers import launch, rows

pytestmark = pytest.mark.slow


def test_local_default_learns(tmp_path):
    run_dir = str(tmp_path / "local-default")
    t0 = time.time()
    res = launch(run_dir, timeout=900)
    wall = time.time() - t0
    assert res.returncode == 0, res.stderr[-5000:]
    evals = [(r.get("eval/at_step", r["step"]), r["eval/reward_mean"]) for r in rows(run_dir)
             if "eval/reward_mean" in r]
    before, after = evals[0][1], evals[-1][1]
    assert evals[0][0] == 0 and before <= 0.2, evals
    assert after >= 0.6, evals
    assert os.path.isfile(os.path.join(run_dir, "reward_curve.png"))
    assert wall < 600, f"the local default took {wall:.0f}s"
    print(json.dumps({"before": before, "after": after, "wall_s": wall}))
