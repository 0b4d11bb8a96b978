"""Kernels that both the model and the trainer use (the fused LM-head logprobs). Depends on `sharding` only."""
