"""Retrieval quality on the CIA World Factbook: recall@k of BM25 and dense MiniLM on generated QA.

    .venv/bin/python bench/retrieval_recall.py [--k 5] [--n-qa 0] [--dense-countries 10]

Two numbers: answer-recall (a top-k passage contains a gold answer as whole words, after SQuAD normalisation;
the usual "top-k accuracy" of open-domain QA) and gold-passage recall (the passage the question was generated
from is in the top-k; stricter, since other passages may hold the answer). BM25 runs over the whole corpus;
dense runs over a subset, every passage of a few random countries (embedding all ~76k passages takes many
minutes on a CPU), with BM25 measured on the same subset beside it. Embeddings are cached, so a second run is fast.

The corpus and QA come from `areal_lite.dataset.factbook` (`build_factbook_corpus`, `build_factbook_qa`):
passages "Country. Section - Field: text", questions on capitals, currencies, official languages
and regions, each with its gold passage id.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from areal_lite.dataset.factbook import build_factbook_corpus, build_factbook_qa  # noqa: E402
from areal_lite.kit.rag import build_index, load_corpus  # noqa: E402
from areal_lite.reward.search_qa import normalize_answer  # noqa: E402


def load_factbook() -> tuple[str, list[dict], list[dict]]:
    """(corpus JSONL path, corpus rows, QA items) built (and cached) by areal_lite.dataset.factbook."""
    corpus_path = build_factbook_corpus()
    with open(build_factbook_qa(), encoding="utf-8") as f:
        qa = [json.loads(line) for line in f if line.strip()]
    return corpus_path, load_corpus(corpus_path), qa


# ----------------------------------------------------------------------------- metric
def recall_at_k(index, qa: list[dict], k: int = 5, batch: int = 64) -> dict[str, float]:
    """{"answer": share of questions with a gold answer string inside a top-k passage,
    "passage": share with the gold passage itself (`gold_doc_id`) among the top-k}."""
    answer_hits = passage_hits = 0
    for start in range(0, len(qa), batch):
        chunk = qa[start : start + batch]
        results = index.retrieve([q["question"] for q in chunk], topk=k)
        for item, docs in zip(chunk, results):
            golds = [g for g in (normalize_answer(a) for a in item["answer"]) if g]
            texts = [f" {normalize_answer(d['contents'])} " for d in docs]
            answer_hits += any(f" {g} " in t for g in golds for t in texts)  # whole words only
            passage_hits += any(d["id"] == item.get("gold_doc_id") for d in docs)
    n = max(len(qa), 1)
    return {"answer": answer_hits / n, "passage": passage_hits / n}


def _fmt(r: dict, k: int) -> str:
    return f"answer-recall@{k} = {r['answer']:.3f}  gold-passage-recall@{k} = {r['passage']:.3f}"


def by_template(qa: list[dict]) -> dict[str, list[dict]]:
    """QA items grouped by question template (areal_lite.dataset.factbook ids look like "capital-fr")."""
    groups: dict[str, list[dict]] = {}
    for item in qa:
        groups.setdefault(str(item.get("id", "all")).split("-")[0], []).append(item)
    return groups


def report(name: str, index, qa: list[dict], k: int) -> dict:
    t0 = time.time()
    r = recall_at_k(index, qa, k)
    ms = 1000 * (time.time() - t0) / max(len(qa), 1)
    print(f"{name:<14} all        ({len(qa):4d} q): {_fmt(r, k)}  ({ms:.1f} ms/question)")
    for template, items in sorted(by_template(qa).items()):
        print(f"{'':<14} {template:<10} ({len(items):4d} q): {_fmt(recall_at_k(index, items, k), k)}")
    return r


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--n-qa", type=int, default=0, help="sample this many questions (0 = all)")
    p.add_argument("--dense-countries", type=int, default=10, help="countries whose passages form the dense subset")
    p.add_argument("--no-dense", action="store_true", help="skip the dense retriever")
    p.add_argument("--index-cache", default=None, help="dense embedding cache dir (default: user cache)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    rng = random.Random(args.seed)

    t0 = time.time()
    path, rows, qa = load_factbook()
    if args.n_qa:
        qa = rng.sample(qa, min(args.n_qa, len(qa)))
    print(f"corpus: {len(rows)} passages, {len(qa)} questions ({time.time() - t0:.1f} s)")

    t0 = time.time()
    bm25 = build_index(path, "bm25")
    print(f"bm25 index over the full corpus: {time.time() - t0:.1f} s")
    report("bm25 full", bm25, qa, args.k)

    if args.no_dense:
        return

    # Dense runs on the complete factbook of a few countries: every passage of a country is a hard
    # distractor for that country's questions, unlike random passages from elsewhere.
    def country(doc_id: str) -> str:
        return doc_id.rsplit("-", 1)[0]

    asked = sorted({country(q["gold_doc_id"]) for q in qa})
    chosen = set(rng.sample(asked, min(args.dense_countries, len(asked))))
    subset = [d for d in rows if country(d["id"]) in chosen]
    qa = [q for q in qa if country(q["gold_doc_id"]) in chosen]
    print(f"\nsubset: all {len(subset)} passages of {len(chosen)} random countries, {len(qa)} questions about them")
    t0 = time.time()
    dense = build_index(subset, "dense", index_cache=args.index_cache)
    print(f"dense index over the subset: {time.time() - t0:.1f} s (embedding, or loading the cache)")
    r_dense = report("dense subset", dense, qa, args.k)
    r_sub = report("bm25 subset", build_index(subset, "bm25"), qa, args.k)
    print(
        f"ratio dense/bm25 on the subset: answer {r_dense['answer'] / max(r_sub['answer'], 1e-9):.2f}, "
        f"passage {r_dense['passage'] / max(r_sub['passage'], 1e-9):.2f}"
    )


if __name__ == "__main__":
    main()
