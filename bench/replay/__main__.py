import sys

from bench.replay.cli import main

sys.exit(main())
