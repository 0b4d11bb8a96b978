"""`launch.py plan`: a discrete-event model of the async pipeline (`sim.py`) and what feeds it (`inputs.py`)."""
