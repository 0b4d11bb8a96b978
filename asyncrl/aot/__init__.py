"""Ahead-of-time views of compiled XLA programs: cost and memory read from the compiled HLO."""
