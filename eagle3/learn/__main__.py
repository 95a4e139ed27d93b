import sys

from .process import learner_main

sys.exit(learner_main())
