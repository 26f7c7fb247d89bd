"""`python -m areal_lite.kit.serve --model-path PATH_OR_ALIAS ...`: run the embedded server (see `--help`)."""

import sys

from areal_lite.kit.serve.cli import main

sys.exit(main())
