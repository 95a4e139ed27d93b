import sys

from .. import tune_process

tune_process()      # before torch loads (eagle3.train.cli imports it): `python -m eagle3.train`, torchrun

from .cli import train_main  # noqa: E402

sys.exit(train_main(sys.argv[1:]))
