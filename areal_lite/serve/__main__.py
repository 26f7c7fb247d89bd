"""`python -m areal_lite.serve --model-path PATH_OR_ALIAS ...`: run the embedded server (see `--help`)."""

import sys

from areal_lite.serve.cli import main

sys.exit(main())
