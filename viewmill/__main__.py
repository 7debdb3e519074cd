"""`python -m viewmill ...`: the `viewmill` command without its console script."""

import sys

from viewmill.cli import main

if __name__ == "__main__":
    sys.exit(main())
