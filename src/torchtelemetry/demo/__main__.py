"""`python -m torchtelemetry.demo` (also what `torchrun -m torchtelemetry.demo` runs on each rank)."""

import sys

from torchtelemetry.demo import main

if __name__ == "__main__":
    sys.exit(main())
