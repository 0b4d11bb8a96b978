"""`launch.py plan`: a discrete-event model of the async pipeline (`sim.py`), what feeds it (`inputs.py`, a run's
logs through `from_run.py`) and what it reports (`result.py`)."""
