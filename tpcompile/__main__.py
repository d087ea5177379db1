"""`python -m tpcompile` runs the command line."""

import sys

from tpcompile.cli import main

if __name__ == "__main__":
    sys.exit(main())
