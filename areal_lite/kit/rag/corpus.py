"""The RAG server's corpus: JSONL rows checked and filled in, as ASearcher's server stores them.

A corpus is JSONL, one passage a row: `id`, `title`, `wikipedia_title`, `contents`. Missing ids and titles are filled
in; a row without `contents`/`text` is an error naming the line. Rows are returned as stored, as ASearcher's server
does, so agent code reading `doc["wikipedia_title"]` and `doc["contents"]` works against either server.
"""

from __future__ import annotations

import hashlib
import json
import os

__all__ = ["load_corpus"]


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
