"""`python -m torchtelemetry <command>`: the `torchtelemetry` console script."""

import sys

from torchtelemetry.cli import main

sys.exit(main())
