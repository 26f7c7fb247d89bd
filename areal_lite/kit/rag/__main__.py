"""`python -m areal_lite.kit.rag --corpus PATH [...]`: run the RAG server (`server.main`)."""

from areal_lite.kit.rag.server import main
from areal_lite.kit.server.procs import exit_now

if __name__ == "__main__":
    main()
    exit_now(0)  # it has stopped serving (kit.server.procs.exit_now says why)
