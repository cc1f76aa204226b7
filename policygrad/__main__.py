"""``python -m policygrad``: the command line (also ``torchrun -m policygrad``)."""

import sys

from policygrad.cli import main

sys.exit(main())
