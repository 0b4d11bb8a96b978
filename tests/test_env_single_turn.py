"""The single-turn environment (`envs/single_turn.py`): a stalled verifier fails the step, naming the sample."""

from types import SimpleNamespace

import numpy as np
import pytest


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

