"""`python -m areal_lite.kit.server --model-path PATH_OR_ALIAS ...`: run the embedded server (see `--help`)."""

from areal_lite.kit.server.cli import main
from areal_lite.kit.server.procs import exit_now

exit_now(main())  # main() has stopped serving and joined its threads (procs.exit_now says why)
