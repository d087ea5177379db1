"""`python -m bench`: the whole benchmark (bench/run.py)."""

import sys

from bench.run import main

if __name__ == "__main__":  # spawned rank processes import this module again under another name
    sys.exit(main())
