"""The RAG server's HTTP side: ASearcher's `/retrieve` + `/access` wire format over a `SearchIndex`, and its CLI.

    python -m areal_lite.kit.rag --corpus factbook.jsonl [--retriever bm25|dense] [--port 5001]

aiohttp on 127.0.0.1; retrieval runs on one worker thread, so `/health` answers while a batch is scored. Errors
follow `utils.jsonhttp`, as the inference server's do. Unknown request keys are refused: a typo like `top_k` would
otherwise silently give 3 results. The `MAX_*` limits bound what one request may ask for.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import logging
import os
import socket
import sys
import time

from aiohttp import web

from areal_lite.kit.rag.index import SearchIndex, build_index
from areal_lite.kit.server.procs import exit_with_parent
from areal_lite.utils.jsonhttp import BadRequest, describe, json_errors_middleware, read_json

__all__ = [
    "MAX_QUERIES",
    "MAX_TOPK",
    "MAX_URLS",
    "MAX_BODY_BYTES",
    "INDEX_KEY",
    "parse_retrieve_request",
    "build_app",
    "main",
]

logger = logging.getLogger(__name__)

MAX_QUERIES = 512
MAX_TOPK = 100
MAX_URLS = 100
MAX_BODY_BYTES = 1 << 20
RETRIEVE_KEYS = {"queries", "topk", "return_scores"}
ACCESS_KEYS = {"urls"}

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
