"""``python -m policygrad``: the command line (also ``torchrun -m policygrad``)."""

import sys

from policygrad.cli import main

if __name__ == "__main__":  # a worker process that imports this module must not start a second run
    sys.exit(main())
