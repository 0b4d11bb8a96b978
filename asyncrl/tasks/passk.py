"""pass@k from n samples per prompt, with the unbiased estimator of Chen et al. (2021, the Codex paper)."""

from __future__ import annotations

from collections.abc import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n (c of them correct) is correct.

    Equals 1 - C(n-c, k) / C(n, k), computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i): no huge binomials, and each
    factor is in [0, 1], so the product cannot overflow or lose everything to cancellation.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def summarize_rewards(rewards: Sequence[Sequence[float]], correct_at: float = 1.0) -> dict[str, float]:
    """Mean reward and pass@k for every k <= n, averaged over prompts.

    `rewards[p]` holds the rewards of prompt p's samples; a sample counts as correct when its reward is at least
    `correct_at` (partial credit does not pass). When prompts have different sample counts, pass@k is reported
    for k up to the smallest count, each prompt using its own n.
    """
    groups = [list(g) for g in rewards]
    if not groups or any(len(g) == 0 for g in groups):
        raise ValueError("summarize_rewards needs at least one prompt and at least one sample per prompt")
    n_min = min(len(g) for g in groups)
    out = {
        "mean_reward": sum(sum(g) / len(g) for g in groups) / len(groups),
        "num_prompts": float(len(groups)),
    }
    correct = [sum(r >= correct_at for r in g) for g in groups]
    for k in range(1, n_min + 1):
        out[f"pass@{k}"] = sum(pass_at_k(len(g), c, k) for g, c in zip(groups, correct)) / len(groups)
    return out
