"""areal_lite.dataset and utils.dataloader: offline GSM8K-style data, arithmetic, factbook search data, resumable
loaders."""

from __future__ import annotations

import json
import os
import pickle
import re

import datasets
import pytest

from areal_lite.api.cli_args import DatasetConfig
from areal_lite.dataset.arithmetic import load_arithmetic, load_products
from areal_lite.dataset.common import to_messages
from areal_lite.dataset.factbook import build_factbook_corpus, build_factbook_qa, factbook_qa_rows, load_search_dataset
from areal_lite.dataset.gsm8k import load_gsm8k
from areal_lite.dataset.loader import load_dataset_from_config
from areal_lite.utils.data import cycle_dataloader
from areal_lite.utils.dataloader import collate_rows, make_dataloader

ANSWER_RE = re.compile(r"#### (-?\d+)$")


@pytest.fixture(scope="module", autouse=True)
def data_cache(tmp_path_factory):
    """Generated files go to a fresh cache for this module (the build path is exercised every run)."""
    root = tmp_path_factory.mktemp("data-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AREAL_LITE_CACHE", str(root))
        yield str(root)


# ---------------------------------------------------------------------------------------------------------------
# GSM8K


def test_gsm_offline_rows_are_gsm8k_format():
    ds = load_gsm8k("train", size=40, seed=0)
    assert len(ds) == 40 and ds.column_names == ["question", "answer"]
    for row in ds:
        assert ANSWER_RE.search(row["answer"]), row["answer"]
        assert not row["question"].endswith("Do not include units.")
        assert row["question"].strip() == row["question"] and row["question"]


def test_gsm_offline_deterministic_and_seeded():
    a = load_gsm8k("train", size=30, seed=0)
    b = load_gsm8k("train", size=30, seed=0)
    c = load_gsm8k("train", size=30, seed=1)
    assert a.to_list() == b.to_list()
    assert a["question"] != c["question"]
    assert len(set(a["question"]) & set(c["question"])) < 5


def test_gsm_train_test_disjoint_whatever_the_seeds():
    train = set(load_gsm8k("train", size=300, seed=0)["question"])
    for seed in (0, 1):
        test = set(load_gsm8k("test", size=100, seed=seed)["question"])
        assert len(test) == 100
        assert not train & test


def test_gsm_local_jsonl_file_and_folder(tmp_path):
    rows = [{"question": f"q{i}", "answer": f"step\n#### {i}"} for i in range(10)]
    file = tmp_path / "gsm.jsonl"
    file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = load_gsm8k(path=str(file))
    assert ds.to_list() == rows
    sub = load_gsm8k(path=str(file), size=4, seed=3)
    assert len(sub) == 4 and sub.to_list() == load_gsm8k(path=str(file), size=4, seed=3).to_list()
    folder = tmp_path / "gsm"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:6]))
    (folder / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[6:]))
    assert load_gsm8k("train", path=str(folder))["question"] == [f"q{i}" for i in range(6)]
    assert load_gsm8k("test", path=str(folder))["question"] == [f"q{i}" for i in range(6, 10)]


def test_gsm_missing_local_path_fails_without_network(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_gsm8k(path=str(tmp_path / "missing.jsonl"))
    with pytest.raises(FileNotFoundError):
        load_gsm8k(path="data/nested/missing")
    with pytest.raises(ValueError, match="unknown split"):
        load_gsm8k("dev", size=3)


# ---------------------------------------------------------------------------------------------------------------
# arithmetic


def test_arithmetic_split_covers_space_disjointly():
    train, test = load_arithmetic("train"), load_arithmetic("test")
    assert len(train) + len(test) == 100 and len(test) == 25
    assert not set(train["question"]) & set(test["question"])
    assert len(set(train["question"])) == len(train)
    for row in train:
        x, op, y = re.fullmatch(r"What is (\d) (\+) (\d)\?", row["question"]).groups()
        assert int(ANSWER_RE.search(row["answer"]).group(1)) == int(x) + int(y)


def test_arithmetic_seeds_and_ops():
    a, b, c = (load_arithmetic(seed=s) for s in (0, 0, 1))
    assert a.to_list() == b.to_list()
    assert a["question"] != c["question"] and set(a["question"]) == set(c["question"])
    mixed = load_arithmetic("train", ops=("+", "-", "*"), max_operand=5)
    for row in mixed:
        result = int(ANSWER_RE.search(row["answer"]).group(1))
        assert result >= 0  # subtraction keeps x >= y
        assert result == eval(row["question"][len("What is ") : -1])
    # More rows than the split holds: repeated in shuffled passes, every problem used before any repeats.
    big = load_arithmetic("test", size=60)
    assert len(big) == 60 and len(set(big["question"][:25])) == 25
    with pytest.raises(ValueError, match="unsupported ops"):
        load_arithmetic(ops=("/",))


def test_products_are_two_digit_and_split_disjointly():
    train, test = load_products("train"), load_products("test", size=50, seed=2)
    assert len(train) == 8100 - 2025 and len(test) == 50
    assert not set(train["question"]) & set(test["question"])
    for row in test:
        x, y = map(int, re.fullmatch(r"What is (\d\d) \* (\d\d)\?", row["question"]).groups())
        assert 10 <= min(x, y) and int(ANSWER_RE.search(row["answer"]).group(1)) == x * y
    with pytest.raises(ValueError, match="min_operand"):
        load_arithmetic(min_operand=10, max_operand=9)


def test_to_messages():
    row = {"question": "What is 1 + 1?", "answer": "#### 2"}
    out = to_messages(row)
    assert out["messages"] == [{"role": "user", "content": "What is 1 + 1?"}]
    assert out["answer"] == "#### 2" and "messages" not in row
    sys_out = to_messages(row, system_prompt="Be brief.")
    assert sys_out["messages"][0] == {"role": "system", "content": "Be brief."}
    mapped = load_arithmetic(size=3).map(to_messages)
    assert mapped[0]["messages"][0]["content"] == mapped[0]["question"]


# ---------------------------------------------------------------------------------------------------------------
# factbook search data


@pytest.fixture(scope="module")
def corpus(data_cache):
    path = build_factbook_corpus()
    assert path.startswith(data_cache)
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    return path, rows


def test_factbook_corpus_rows(corpus):
    path, rows = corpus
    assert len(rows) > 60_000
    ids = [r["id"] for r in rows]
    assert len(set(ids)) == len(ids)
    for r in rows[:: len(rows) // 200]:
        assert set(r) == {"id", "title", "wikipedia_title", "contents"}
        assert r["title"] == r["wikipedia_title"]
        assert r["contents"].startswith(r["title"] + ". ")
        assert not re.search(r"</?(p|br|strong|em|b)>", r["contents"])
        assert "&eacute;" not in r["contents"]
    capital = [r for r in rows if r["contents"] == "France. Government - Capital - name: Paris"]
    assert len(capital) == 1
    ds = datasets.load_dataset("json", data_files=path, split="train")
    assert len(ds) == len(rows)


def test_factbook_corpus_is_cached_and_small_variant(corpus, tmp_path):
    path, _ = corpus
    mtime = os.stat(path).st_mtime_ns
    assert build_factbook_corpus() == path and os.stat(path).st_mtime_ns == mtime
    small = build_factbook_corpus(out_path=str(tmp_path / "small.jsonl"), max_countries=3)
    with open(small) as f:
        titles = {json.loads(line)["title"] for line in f}
    assert len(titles) == 3
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]


def test_factbook_qa_answers_are_in_gold_passages(corpus):
    _, rows = corpus
    by_id = {r["id"]: r for r in rows}
    qa = factbook_qa_rows()
    assert len(qa) > 500
    assert len({q["id"] for q in qa}) == len(qa)
    kinds = {q["id"].split("-")[0] for q in qa}
    assert kinds == {"capital", "currency", "language", "region"}
    for q in qa:
        assert q["question"].endswith("?")
        assert isinstance(q["answer"], list) and q["answer"]
        assert q["answer"][0] in by_id[q["gold_doc_id"]]["contents"], q
    france = next(q for q in qa if q["question"] == "What is the capital of France?")
    assert france["answer"] == ["Paris"]
    us = next(q for q in qa if q["question"] == "What is the capital of the United States?")
    assert "Washington" in us["answer"]


def test_factbook_qa_file_seeded_subset(tmp_path):
    a = build_factbook_qa(str(tmp_path / "a.jsonl"), size=50, seed=0)
    b = build_factbook_qa(str(tmp_path / "b.jsonl"), size=50, seed=0)
    c = build_factbook_qa(str(tmp_path / "c.jsonl"), size=50, seed=1)
    read = lambda p: [json.loads(line) for line in open(p)]  # noqa: E731
    assert read(a) == read(b) and read(a) != read(c)
    assert len(read(a)) == 50


def test_search_dataset_splits_disjoint():
    train = load_search_dataset(split="train")
    test = load_search_dataset(split="test")
    assert {"id", "question", "answer", "gold_doc_id"} <= set(train.column_names)
    assert len(test) > 50 and len(train) > 3 * len(test)
    assert not set(train["question"]) & set(test["question"])
    sub = load_search_dataset(split="test", size=10, seed=2)
    assert len(sub) == 10 and set(sub["id"]) <= set(test["id"])


# ---------------------------------------------------------------------------------------------------------------
# config dispatch and loaders


def test_load_dataset_from_config():
    arith = load_dataset_from_config(DatasetConfig(type="arith", split="test", seed=0))
    assert len(arith) == 25
    gsm = load_dataset_from_config(DatasetConfig(type="gsm8k", size=5, seed=3))
    assert gsm.to_list() == load_gsm8k("train", size=5, seed=3).to_list()
    products = load_dataset_from_config(DatasetConfig(type="products", split="test", size=4, seed=1))
    assert products.to_list() == load_products("test", size=4, seed=1).to_list()
    qa = load_dataset_from_config(DatasetConfig(type="factbook_qa", split="test", size=7))
    assert len(qa) == 7
    bad = DatasetConfig()
    bad.type = "imagenet"
    with pytest.raises(ValueError, match="unknown dataset type"):
        load_dataset_from_config(bad)


def _collect(loader, n=None):
    out = []
    for batch in loader:
        out.append([row["question"] for row in batch])
        if n is not None and len(out) == n:
            break
    return out


def test_dataloader_batches_and_seeded_shuffle():
    ds = load_arithmetic(size=30)
    dl = make_dataloader(ds, batch_size=4, seed=5)
    batches = list(dl)
    assert len(batches) == len(dl) == 7  # drop_last
    assert all(isinstance(b, list) and len(b) == 4 and isinstance(b[0], dict) for b in batches)
    assert _collect(make_dataloader(ds, 4, seed=5)) == _collect(make_dataloader(ds, 4, seed=5))
    assert _collect(make_dataloader(ds, 4, seed=6)) != _collect(make_dataloader(ds, 4, seed=5))
    ordered = _collect(make_dataloader(ds, 4, shuffle=False))
    assert [q for b in ordered for q in b] == ds["question"][:28]
    pickle.dumps(collate_rows)
    # Works on a plain list of dicts too.
    assert _collect(make_dataloader([{"question": str(i)} for i in range(8)], 4, shuffle=False)) == [
        ["0", "1", "2", "3"],
        ["4", "5", "6", "7"],
    ]
    with pytest.raises(ValueError, match="fewer than batch_size"):
        make_dataloader(ds.select(range(3)), batch_size=4)


@pytest.mark.parametrize("stop_after", [0, 3, 7, 10])
def test_dataloader_resume_matches_uninterrupted_run(stop_after):
    """Save state after `stop_after` batches (mid-epoch, at the epoch boundary, in epoch 2), resume, compare."""
    ds = load_arithmetic(size=30)
    reference = cycle_dataloader(make_dataloader(ds, 4, seed=1))
    expected = [[r["question"] for r in next(reference)] for _ in range(stop_after + 12)]

    dl = make_dataloader(ds, 4, seed=1)
    gen = cycle_dataloader(dl)
    first = [[r["question"] for r in next(gen)] for _ in range(stop_after)]
    state = dl.state_dict()
    resumed_dl = make_dataloader(ds, 4, seed=1)
    resumed_dl.load_state_dict(state)
    resumed = cycle_dataloader(resumed_dl)
    rest = [[r["question"] for r in next(resumed)] for _ in range(12)]
    assert first + rest == expected


def test_cycle_dataloader_reshuffles_each_epoch():
    ds = load_arithmetic(size=32)
    gen = cycle_dataloader(make_dataloader(ds, 8, seed=0))
    epoch1 = [r["question"] for _ in range(4) for r in next(gen)]
    epoch2 = [r["question"] for _ in range(4) for r in next(gen)]
    assert sorted(epoch1) == sorted(epoch2) == sorted(ds["question"])
    assert epoch1 != epoch2  # itertools.cycle would replay epoch 1
