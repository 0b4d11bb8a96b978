"""`python -m asyncrl.evaluate`: kept for existing scripts; the command lives in `asyncrl/cli/evaluate.py`."""

import sys

from asyncrl.cli.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
