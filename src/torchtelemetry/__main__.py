"""`python -m torchtelemetry <command>`: the `torchtelemetry` console script."""

import sys

from torchtelemetry.cli import main

if __name__ == "__main__":
    sys.exit(main())
