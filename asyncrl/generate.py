"""`python -m asyncrl.generate`: kept for existing scripts; the command lives in `asyncrl/cli/generate.py`."""

import sys

from asyncrl.cli.generate import main

if __name__ == "__main__":
    sys.exit(main())
