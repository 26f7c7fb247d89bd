"""Datasets, as AReaL 1.0.4's `areal.dataset`, offline: GSM8K-style math (`gsm8k`), easy arithmetic (`arithmetic`),
a search corpus and QA from the CIA World Factbook (`factbook`), local JSON/JSONL files (`common`), and the loader a
config names (`loader`).

Design decisions:
- Offline by default. No package ships the real GSM8K, so `load_gsm8k()` generates GSM8K-format problems with
  `reasoning_gym`'s GSM-Symbolic templates (derived from GSM8K). The real loaders stay real: a local JSON/JSONL file
  or folder goes through `datasets.load_dataset("json", ...)` and `"openai/gsm8k"` through the hub.
- Rows are plain dicts with GSM8K's keys: `question` and `answer` = "<reasoning>\n#### N". Search rows have
  `question` and `answer` = list of gold strings; corpus rows have `id`, `title`, `wikipedia_title`, `contents`.
- Everything is a `datasets.Dataset` and deterministic given the seed. Train and test never overlap: a problem's
  split is decided by a hash of the problem itself (or its place in a fixed ordering), never by the seed.
- Generated files live under `<cache root>/data`, written to a temp file and renamed under a file lock: existence
  means complete.
"""
