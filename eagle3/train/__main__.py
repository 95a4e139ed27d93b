import sys

from .pipeline import train_main

sys.exit(train_main(sys.argv[1:]))
