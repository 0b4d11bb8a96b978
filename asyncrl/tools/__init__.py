"""Tools the model may call during an episode: the call formats (`calls.py`), their config (`config.py`) and the
sandbox that runs model-written Python (`sandbox.py`, with its child side `sandbox_runner.py`)."""
