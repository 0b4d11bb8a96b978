"""A synthetic multi-turn task whose reward can only be reached through the environment: each prompt hides a
letter, and the only way to learn it is the lookup action.

    prompt  "k381>"        (a random key: it says nothing of the hidden letter)
    turn 0  "?"            the lookup action (then EOS)
    obs     "=q>"          the environment answers with the hidden letter
    turn 1  "q"            the answer (then EOS), graded exact by the task's verifier

Answering at once is a guess (reward 1 in 26). The tiny model learns, by RL, to look the letter up and copy it: the
reward rises from the guess rate toward 1 and the share of episodes that use the action rises with it. The format
warm-start (`warmstart_examples`) teaches the *format* of both ways (half the examples look up, half answer at
once) with answers drawn at random, never the hidden letter: the rule, look up and then copy, is left to RL.
(One letter, not a longer secret: with two digits a guess after a lookup is right 1 time in 100, too rarely for
RL to find the copy on a CPU budget; the action share then random-walks to 0, measured.)
The task and its episode (`LookupEnv`) are both here: one environment, one place.
"""

from __future__ import annotations

import random
import string
from collections.abc import Iterator, Sequence
from typing import Any

from asyncrl.envs.spec import EnvironmentSpec
from asyncrl.rollout import StepResult, Turn
from asyncrl.tasks.base import Sample, Score, Task, check_split, stable_hash
from asyncrl.tasks.config import TaskConfig, TaskSourceConfig
from asyncrl.validate import check_choice

ACTION = "?"
LETTERS = string.ascii_lowercase


class LookupTask(Task):
    name = "lookup"

    def __init__(self, eval_size: int = 256, label: str = "lookup", use: str = "both") -> None:
        self.eval_size, self.label, self.use = eval_size, label, use

    def _sample(self, rng: random.Random, split: str, i: int) -> Sample:
        key = "".join(str(rng.randrange(10)) for _ in range(3))
        secret = rng.choice(LETTERS)
        return Sample(f"{self.label}/{split}/{i}", f"k{key}>", secret, {"task": self.label})

    def samples(self, split: str, seed: int) -> Iterator[Sample]:
        check_split(split)
        if self.use not in ("both", split):
            return
        rng = random.Random(stable_hash("lookup", split, seed))
        i = 0
        while split == "train" or i < self.eval_size:
            yield self._sample(rng, split, i)
            i += 1

    def score(self, completion: str, sample: Sample) -> Score:
        text = completion.strip()
        if not text:
            return Score(0.0, "no_answer")
        ok = text == sample.answer
        return Score(1.0 if ok else 0.0, "correct" if ok else "wrong", text[:20])

    def warmstart_examples(self, tokenizer: Any, n: int, seed: int, chat: bool) -> list[tuple[list[int], list[int]]]:
        """(token ids, loss mask) pairs in the episode's own layout: prompt, turns (masked in), observations
        (masked out). Half look up, half answer at once; every answer is a random letter, independent of the
        hidden one."""
        rng = random.Random(seed)
        eos = [tokenizer.eos_id]
        out = []
        for s, _ in zip(self.samples("train", seed), range(n)):
            prompt = tokenizer.encode_prompt(s.prompt, chat=chat)
            guess = tokenizer.encode(rng.choice(LETTERS)) + eos
            ids, mask = list(prompt), [0] * len(prompt)
            if rng.random() < 0.5:
                action = tokenizer.encode(ACTION) + eos
                obs = tokenizer.encode(observation(rng.choice(LETTERS)))
                ids += action + obs
                mask += [1] * len(action) + [0] * len(obs)
            ids += guess
            mask += [1] * len(guess)
            out.append((ids, mask))
        return out


def observation(secret: str) -> str:
    return f"={secret}>"


def build_lookup(source: TaskSourceConfig, cfg: TaskConfig, where: str) -> LookupTask:
    opts = dict(source.options)
    label = opts.pop("label", "lookup")
    for key in opts:
        check_choice(f"{where}.options", key, ["label"])
    return LookupTask(eval_size=cfg.eval_size, label=str(label), use=source.split)


class LookupEnv:
    """The episode: the action "?" is answered with the hidden letter; anything else is the answer, graded by the
    task's verifier."""

    def __init__(self, prompt_ids: Sequence[int], sample: Any, verifier: Any, timeout_s: float, tokenizer: Any):
        self.prompt_ids, self.sample, self.verifier = list(prompt_ids), sample, verifier
        self.timeout_s, self.tokenizer = timeout_s, tokenizer
        self.lookups = 0

    def reset(self) -> list[int]:
        return list(self.prompt_ids)

    def step(self, turn: Turn) -> StepResult:
        if turn.text.strip() == ACTION:
            self.lookups += 1
            if turn.last:  # no turn left to answer in
                return StepResult(None, 0.0, True, "no_answer", {"action": True})
            return StepResult(self.tokenizer.encode(observation(self.sample.answer)), 0.0, False, None,
                              {"action": True})
        score = self.verifier.submit(turn.text, self.sample).result(timeout=self.timeout_s)
        return StepResult(None, float(score.reward), True, score.reason, {"action": False})


ENVIRONMENT = EnvironmentSpec(task=build_lookup, episode=LookupEnv)
