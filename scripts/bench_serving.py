"""The serving benchmark: the same command as `eagle3 bench serve` (eagle3/bench/serving.py has its
flags, defaults and method)."""
import sys

from eagle3.bench.serving import main

if __name__ == "__main__":
    sys.exit(main())
