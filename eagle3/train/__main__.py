import sys

from .cli import train_main

sys.exit(train_main(sys.argv[1:]))
