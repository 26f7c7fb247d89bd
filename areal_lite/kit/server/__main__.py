"""`python -m areal_lite.kit.server --model-path PATH_OR_ALIAS ...`: run the embedded server (see `--help`)."""

import sys

from areal_lite.kit.server.cli import main

sys.exit(main())
