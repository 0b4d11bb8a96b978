"""Several tasks as one: training interleaves them by weight, eval concatenates their held-out sets."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

from asyncrl.tasks.base import Sample, Score, Task, check_split


class MixtureTask(Task):
    """Interleaves sources deterministically in proportion to their weights.

    Smooth weighted round-robin (each step the source furthest behind its share goes next) rather than random
    draws: every window of a batch gets close to the configured proportions, so per-source reward curves are
    not blurred by sampling noise in the mix itself. Each sample is scored by the source that made it, found
    through `sample.metadata["task"]` (the source's label).
    """

    name = "mixture"

    def __init__(self, tasks: Sequence[Task], weights: Sequence[float]) -> None:
        if len(tasks) != len(weights) or not tasks:
            raise ValueError(f"MixtureTask needs one weight per task (got {len(tasks)} tasks, {len(weights)} weights)")
        if any(w <= 0 for w in weights):
            raise ValueError(f"MixtureTask weights must be > 0, got {list(weights)}")
        self.tasks = list(tasks)
        self.weights = [float(w) for w in weights]
        self.by_label = {t.label: t for t in self.tasks}
        if len(self.by_label) != len(self.tasks):
            raise ValueError(f"MixtureTask sources need distinct labels, got {[t.label for t in self.tasks]}")
        self.label = "+".join(t.label for t in self.tasks)

    def samples(self, split: str, seed: int) -> Iterator[Sample]:
        check_split(split)
        if split == "eval":
            for t in self.tasks:
                yield from t.samples("eval", seed)
            return
        streams = {}
        for i, t in enumerate(self.tasks):
            # Peek, so a source with no train stream (split: eval) never takes a turn and skews the rotation.
            stream = t.samples("train", seed)
            first = next(stream, None)
            if first is not None:
                streams[i] = itertools.chain([first], stream)
        credit = {i: 0.0 for i in streams}
        while streams:
            total = sum(self.weights[i] for i in streams)
            for i in streams:
                credit[i] += self.weights[i]
            pick = max(streams, key=lambda i: (credit[i], -i))
            credit[pick] -= total
            try:
                yield next(streams[pick])
            except StopIteration:
                del streams[pick], credit[pick]

    def score(self, completion: str, sample: Sample) -> Score:
        label = sample.metadata.get("task")
        if label not in self.by_label:
            raise KeyError(f"sample {sample.id!r} has metadata task={label!r}; this mixture has {list(self.by_label)}")
        return self.by_label[label].score(completion, sample)

    def render_answer(self, answer: str, sample: Sample) -> str:
        return self.by_label[sample.metadata.get("task")].render_answer(answer, sample)

    def warmup(self) -> None:
        for t in self.tasks:
            t.warmup()
