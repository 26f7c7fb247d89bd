"""A local retrieval (RAG) server speaking ASearcher's `/retrieve` + `/access` wire format.

    python -m areal_lite.kit.rag --corpus factbook.jsonl [--retriever bm25|dense] [--port 5001]

- `corpus`: the JSONL rows (`load_corpus`);
- `index`: the BM25 and dense retrievers and the `SearchIndex` behind the routes (`build_index`);
- `server`: request validation, the aiohttp app (`build_app`) and the CLI (`main`);
- `launch`: the server as a child process (`launch_rag_server`, `RAGServerHandle`).

The names are re-exported lazily, so `import areal_lite.kit.rag` loads neither numpy nor aiohttp until one is used.
"""

from areal_lite.utils.lazy import lazy_exports

_LAZY_IMPORTS = {
    "load_corpus": "areal_lite.kit.rag.corpus",
    "BM25Retriever": "areal_lite.kit.rag.index",
    "DenseRetriever": "areal_lite.kit.rag.index",
    "SearchIndex": "areal_lite.kit.rag.index",
    "build_index": "areal_lite.kit.rag.index",
    "dense_model_path": "areal_lite.kit.rag.index",
    "MAX_QUERIES": "areal_lite.kit.rag.server",
    "MAX_TOPK": "areal_lite.kit.rag.server",
    "MAX_URLS": "areal_lite.kit.rag.server",
    "MAX_BODY_BYTES": "areal_lite.kit.rag.server",
    "INDEX_KEY": "areal_lite.kit.rag.server",
    "parse_retrieve_request": "areal_lite.kit.rag.server",
    "build_app": "areal_lite.kit.rag.server",
    "main": "areal_lite.kit.rag.server",
    "RAGServerHandle": "areal_lite.kit.rag.launch",
    "launch_rag_server": "areal_lite.kit.rag.launch",
}

__all__ = [
    "load_corpus",
    "BM25Retriever",
    "DenseRetriever",
    "SearchIndex",
    "build_index",
    "build_app",
    "RAGServerHandle",
    "launch_rag_server",
    "main",
]
__getattr__, __dir__ = lazy_exports(__name__, _LAZY_IMPORTS)
