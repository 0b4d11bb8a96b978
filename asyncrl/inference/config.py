"""Inference engine config (the blog's InferenceConfig)."""

from __future__ import annotations

from dataclasses import dataclass

from asyncrl.validate import check, check_choice

DEFAULT_THINK_PHRASE = "Okay, time is up. Let me stop thinking and formulate a final answer now.\n</think>"


@dataclass(frozen=True)
class InferenceConfig:
    group_size: int = 8
    """Samples drawn per prompt (G). Each finished group becomes one rollout record."""
    max_decode_batch_size: int = 8
    """In-flight rows per replica in the continuous-batching loop."""
    max_prefill_prompts: int = 4
    """Prompts prefilled together; the decode loop then draws group_size rows from each."""
    max_seq_len: int = 64
    """Prompt plus completion length; a row reaching it is stopped with a forced EOS (logprob 0)."""
    max_new_tokens: int | None = None
    """Optional cap on sampled tokens per row (a forced EOS follows); None means only max_seq_len limits."""
    min_prefill_bucket: int = 16
    """Smallest power-of-two prompt bucket; prompts are padded to the next power of two at or above this."""
    temperature: float = 1.0
    """Sampling temperature; 0 means greedy. Logprobs are log_softmax(logits / temperature) (see sampling.py)."""
    reasoning_budget: int | None = None
    """If set, a row that has not emitted the end-of-think token by this length gets `think_phrase` forced in."""
    think_phrase: str = DEFAULT_THINK_PHRASE
    """Phrase forced at the reasoning budget; must end with the tokenizer's end-of-think token."""
    decode_chunk_steps: int = 16
    """Longest run of decode steps between two returns to the host when no row finishes. A weight sync waits
    at most this many steps per replica; smaller means prompter syncs and more host round trips."""
    tp: int = 1
    """Devices per replica (tensor parallel). Local devices are split into groups of tp, one replica each."""
    replica_mode: str = "threads"
    """'threads': one independent replica per device group, each driven by its own thread (the blog's default).
    'spmd': a single dp x tp mesh over the local devices, batch sharded over dp, shard_map row substitution."""
    params_dtype: str = "bfloat16"
    """Dtype of the weights the trainer sends to inference."""
    kv_cache_dtype: str = "bfloat16"
    """Dtype of the KV cache."""
    prefill_attention: str = "auto"
    """Attention of a prefill over its own prompt tokens: 'auto' uses the Pallas flash kernel (models/flash.py) on
    TPU, where a 4096-token bucket's dense scores would otherwise go through HBM (measured by `launch.py aot`: the
    v6e prefill[4096] at 11x its ideal), the reference attention elsewhere; 'flash' or 'reference' force one."""
    max_turns: int = 1
    """Model turns per episode. 1: a single-turn task (one decode, graded once), compiled exactly as it always was.
    More: after each turn the task's environment answers with an observation, appended to the row's KV cache, and
    the row decodes again; the turn `max_turns` tells the environment it is the last."""
    max_observation_tokens: int | None = None
    """Cap on one observation's tokens: a longer one ends the episode (`end_reason` "obs_cap"). None: only the
    context (max_seq_len) limits."""
    max_parked_rows: int | None = None
    """Rows of saved KV cache for episodes waiting on their environment, so their decode slots serve other rows
    meanwhile (None: max_decode_batch_size). An episode that finds the store full keeps going by re-prefilling its
    history when its observation comes (correct, slower). Only with max_turns > 1."""
    extend_wait_s: float = 0.5
    """How long a continuation whose observation came back may wait for others, to be extended together (one
    extend costs a weight read, like a decode step, however many rows it takes), while other rows keep every decode
    slot busy. It never waits when a slot would idle, nor when the park store has fewer than max_prefill_prompts
    free rows (the turns that end meanwhile would find it full and re-prefill). 0: extend at once. Measured on a
    2-core CPU, 3-turn episodes of 32-token turns, a 0.5 s environment: 0.2 s gave 6.3-6.6 rows an extend, 0.5 s
    gave 7.9-8.0 (full) and 4-23% more tokens/s in three alternating pairs of runs."""
    decode_feed_tokens: int = 16
    """A continuation of at most this many tokens (the turn's last sampled token and the observation) goes back into
    a free decode slot from its parked cache, and the decode steps feed its tokens one a step while the other rows
    decode beside it (chunked prefill, a token at a time); a longer one goes through `extend`. A fed token costs its
    slot one row-step; an extend pauses every slot for a pass over the weights, shared by up to max_prefill_prompts
    continuations that wait (extend_wait_s) to share it. Measured on a 2-core CPU, 3-turn episodes of 32-token
    turns and 5-token continuations: as many tokens/s or a few % more, and the decode slots busy 0.96 of the wall
    time instead of 0.88 (`benchmarks/README.md`, "multiturn"). At target scale, Qwen3-8B on v5p (44 rows, a 17.4
    ms step; an 8-token extend of up to 4 rows 11.7 ms, `launch.py aot`): an extend costs the batch what 7.4 fed
    tokens a continuation cost with 4 rows to an extend, 30 with one. 0: every continuation through extend."""
    env_workers: int | None = None
    """Threads that run environment steps (tools, games, the verifier) off the decode thread. None: one per row that
    can wait on its environment at once (the park store plus the decode batch, at least 16), so a slow step queues
    behind no other: with too few, a 0.5 s step caps a replica at env_workers / 0.5 steps per second (measured:
    16 threads held a tiny model's decode slots 6% busy)."""

    def __post_init__(self) -> None:
        check("inference.group_size", self.group_size, self.group_size >= 1, ">= 1")
        check("inference.max_decode_batch_size", self.max_decode_batch_size, self.max_decode_batch_size >= 1, ">= 1")
        check("inference.max_prefill_prompts", self.max_prefill_prompts, self.max_prefill_prompts >= 1, ">= 1")
        check("inference.max_seq_len", self.max_seq_len, self.max_seq_len >= 2, ">= 2")
        if self.max_new_tokens is not None:
            check("inference.max_new_tokens", self.max_new_tokens, self.max_new_tokens >= 1, ">= 1")
        b = self.min_prefill_bucket
        check("inference.min_prefill_bucket", b, b >= 1 and (b & (b - 1)) == 0, "a power of two >= 1")
        check("inference.temperature", self.temperature, self.temperature >= 0, ">= 0 (0 = greedy)")
        if self.reasoning_budget is not None:
            check("inference.reasoning_budget", self.reasoning_budget, 0 < self.reasoning_budget < self.max_seq_len,
                  f"in (0, max_seq_len={self.max_seq_len})")
        check("inference.decode_chunk_steps", self.decode_chunk_steps, self.decode_chunk_steps >= 1, ">= 1")
        check("inference.tp", self.tp, self.tp >= 1, ">= 1")
        check_choice("inference.replica_mode", self.replica_mode, ("threads", "spmd"))
        check_choice("inference.params_dtype", self.params_dtype, ("float32", "bfloat16", "float16"))
        check_choice("inference.kv_cache_dtype", self.kv_cache_dtype, ("float32", "bfloat16", "float16"))
        check_choice("inference.prefill_attention", self.prefill_attention, ("auto", "reference", "flash"))
        check("inference.max_turns", self.max_turns, self.max_turns >= 1, ">= 1")
        if self.max_observation_tokens is not None:
            check("inference.max_observation_tokens", self.max_observation_tokens, self.max_observation_tokens >= 1,
                  "null or >= 1")
        if self.max_parked_rows is not None:
            check("inference.max_parked_rows", self.max_parked_rows, self.max_parked_rows >= 1, "null or >= 1")
        check("inference.extend_wait_s", self.extend_wait_s, self.extend_wait_s >= 0, ">= 0")
        check("inference.decode_feed_tokens", self.decode_feed_tokens, self.decode_feed_tokens >= 0, ">= 0")
        if self.env_workers is not None:
            check("inference.env_workers", self.env_workers, self.env_workers >= 1, "null or >= 1")

    @property
    def generation_budget(self) -> int:
        """The most model tokens one completion can hold, closing EOS included: max_new_tokens sampled ones plus
        the EOS slot per turn, or, with only max_seq_len limiting, max_seq_len less the shortest (one-token)
        prompt. (Observation tokens are not model tokens: the loss never counts them.)"""
        if self.max_new_tokens is not None:
            return min(self.max_turns * (self.max_new_tokens + 1), self.max_seq_len - 1)
        return self.max_seq_len - 1

    @property
    def env_threads(self) -> int:
        if self.env_workers is not None:
            return self.env_workers
        return max(16, self.parked_rows + self.max_decode_batch_size)

    @property
    def parked_rows(self) -> int:
        """Rows of the park store: 0 for a single-turn engine."""
        if self.max_turns == 1:
            return 0
        return self.max_parked_rows if self.max_parked_rows is not None else self.max_decode_batch_size
