"""`python -m areal_lite.kit.rag --corpus PATH [...]`: run the RAG server (`server.main`)."""

from areal_lite.kit.rag.server import main

if __name__ == "__main__":
    main()
