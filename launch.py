"""asyncrl launcher: a thin Ray driver. The commands live in asyncrl/cli, the logic in asyncrl/orchestration.

    python launch.py [--config-name NAME] [key=value | group=option ...]   run (local Ray cluster, or RAY_ADDRESS)
    python launch.py submit [--address URL] [--wait] [--config-name NAME] [overrides]   submit as a Ray Job
    python launch.py status JOB_ID | logs JOB_ID | stop JOB_ID [--address URL]
    python launch.py roofline --model llama-3.1-8b --chip v5p --chips 32 ...        pick the train/inference split
    python launch.py aot [--config-name NAME] [overrides] [--topology v5p:2x4x4] [--json]   compile for a TPU slice
    python launch.py plan --from-run runs/NAME [--what-if replicas=2 max_lag=2]   model the pipeline of a run
    python launch.py generate ... | evaluate ...                                    (also python -m asyncrl.generate)
"""

from __future__ import annotations

import sys

from asyncrl.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
