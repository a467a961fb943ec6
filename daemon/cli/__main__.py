"""`python -m daemon.cli`: the same command line as the `buzz-broker` console script."""

import sys

from daemon.cli import main

sys.exit(main())
