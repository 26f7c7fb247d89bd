"""Every exercise's check accepts the solution and rejects plausible wrong ones.

A check that prints True for a wrong answer teaches the wrong thing, so each one is tried here against mistakes a
learner is likely to make. The cells come from the notebook sources (notebooks/src): the notebook's imports,
the exercise cell with its `# BEGIN SOLUTION` region either kept or replaced by a wrong body, then the `# CHECK` cell
that follows it. A check fails by raising AssertionError (areal_lite.check_cases names the case, expected and got).
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import glob
import inspect
import io
import itertools
import json
import os
import re
import textwrap
from types import SimpleNamespace

import pytest
from _sources import code_cells

from areal_lite.api.io_struct import ModelResponse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

REGION = re.compile(r"^(?P<indent>[ \t]*)# BEGIN SOLUTION.*?^[ \t]*# END SOLUTION[ \t]*$", re.M | re.S)


def f1_counting(common: str) -> str:
    """An F1 body that differs from the solution only in how it counts the common tokens (`common`)."""
    return f"""
        if not pred_tokens or not gold_tokens:
            return float(pred_tokens == gold_tokens)
        common = {common}
        if common == 0:
            return 0.0
        precision, recall = common / len(pred_tokens), common / len(gold_tokens)
        return 2 * precision * recall / (precision + recall)
    """


# 11's three Warehouse methods, a solution region each under the signature and docstring the notebook gives: a wrong
# or right version changes some of the bodies.
WAREHOUSE = {
    "count": """
        if fruit not in self.stock:
            raise ValueError(f"there are no {fruit} here; the warehouse has {', '.join(sorted(self.stock))}")
        return str(self.stock[fruit])
        """,
    "report": """
        self.reported = number
        self.done = True
        return "reported"
        """,
    "get_reward": "return 1.0 if self.reported == self.stock[self.asked] else 0.0",
}


def warehouse(**bodies: str) -> list[str]:
    """The bodies of 11's three solution regions, in order: each the solution's unless `bodies` gives another."""
    assert set(bodies) <= set(WAREHOUSE), f"no such method: {set(bodies) - set(WAREHOUSE)}"
    return [bodies.get(name, body) for name, body in WAREHOUSE.items()]


# Wrong bodies for the solution regions, by notebook: mistakes the check must catch.
WRONG = {
    "02_rewards_and_tools": {
        "set-based F1": """
            if not pred_tokens or not gold_tokens:
                return float(pred_tokens == gold_tokens)
            common = len(set(pred_tokens) & set(gold_tokens))
            if common == 0:
                return 0.0
            precision, recall = common / len(set(pred_tokens)), common / len(set(gold_tokens))
            return 2 * precision * recall / (precision + recall)
        """,
        "two empty answers score 0": """
            common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
            if common == 0:
                return 0.0
            precision, recall = common / len(pred_tokens), common / len(gold_tokens)
            return 2 * precision * recall / (precision + recall)
        """,
        "any empty answer scores 1": """
            if not pred_tokens or not gold_tokens:
                return 1.0
            common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
            if common == 0:
                return 0.0
            precision, recall = common / len(pred_tokens), common / len(gold_tokens)
            return 2 * precision * recall / (precision + recall)
        """,
        **{
            name: f1_counting(common)
            for name, common in {
                "set intersection over token counts": "len(set(pred_tokens) & set(gold_tokens))",
                "counts every predicted token found in gold": "sum(token in gold_tokens for token in pred_tokens)",
                "counts every gold token found in the prediction": "sum(token in pred_tokens for token in gold_tokens)",
                "the smaller of the two found-in counts": (
                    "min(sum(t in gold_tokens for t in pred_tokens), sum(t in pred_tokens for t in gold_tokens))"
                ),
                "the larger count of each shared token": (
                    "sum(max(Counter(pred_tokens)[t], Counter(gold_tokens)[t])"
                    " for t in set(pred_tokens) & set(gold_tokens))"
                ),
                "counts the kinds of shared tokens, not how often": "len(Counter(pred_tokens) & Counter(gold_tokens))",
            }.items()
        },
    },
    "06_multiturn_feedback": {
        "no discount": """
            following = 0.0
            for k in reversed(range(len(rewards))):
                following = rewards[k] + following
                returns[k] = following
        """,
        "sums forward": """
            earlier = 0.0
            for k in range(len(rewards)):
                earlier = rewards[k] + gamma * earlier
                returns[k] = earlier
        """,
        "discounts from the first turn": """
            for k in range(len(rewards)):
                returns[k] = sum(gamma ** j * rewards[j] for j in range(k, len(rewards)))
        """,
    },
    "09_openai_agent": {
        "no discount": """
            for i in range(len(rewards)):
                discounted[i] = sum((r or 0.0) for r in rewards[i:])
        """,
        "walks forward": """
            earlier = 0.0
            for i in range(len(rewards)):
                earlier = (rewards[i] or 0.0) + turn_discount * earlier
                discounted[i] = earlier
        """,
        "discounts the raw next reward, not the discounted one": """
            for i in range(len(rewards)):
                following = rewards[i + 1] if i + 1 < len(rewards) else 0.0
                discounted[i] = (rewards[i] or 0.0) + turn_discount * (following or 0.0)
        """,
        "replaces a set reward instead of adding to it": """
            following = 0.0
            for i in reversed(range(len(rewards))):
                following = rewards[i] if rewards[i] is not None else turn_discount * following
                discounted[i] = following
        """,
    },
    "12_judge": {
        "counts the pairs whose true rewards are equal, as ties": """
            for i in range(len(truth)):
                for j in range(i + 1, len(truth)):
                    same = (judged[i] - judged[j]) * (truth[i] - truth[j])
                    counts["agree" if same > 0 else "disagree" if same < 0 else "tie"] += 1
        """,
        "a tie counts as agreement": """
            for i in range(len(truth)):
                for j in range(i + 1, len(truth)):
                    if truth[i] != truth[j]:
                        same = (judged[i] - judged[j]) * (truth[i] - truth[j])
                        counts["agree" if same >= 0 else "disagree"] += 1
        """,
        "counts every pair twice, (i, j) and (j, i)": """
            for i in range(len(truth)):
                for j in range(len(truth)):
                    if i != j and truth[i] != truth[j]:
                        same = (judged[i] - judged[j]) * (truth[i] - truth[j])
                        counts["agree" if same > 0 else "disagree" if same < 0 else "tie"] += 1
        """,
        "the judge's order alone, not the truth's direction": """
            for i in range(len(truth)):
                for j in range(i + 1, len(truth)):
                    if truth[i] != truth[j]:
                        d = judged[i] - judged[j]
                        counts["agree" if d > 0 else "disagree" if d < 0 else "tie"] += 1
        """,
    },
    "10_lora": {
        "scales by alpha": "return x @ weight.T + alpha * (x @ lora_A.T) @ lora_B.T",
        "scales by rank / alpha": "return x @ weight.T + (rank / alpha) * (x @ lora_A.T) @ lora_B.T",
        "no scale": "return x @ weight.T + (x @ lora_A.T) @ lora_B.T",
        "scales by alpha / sqrt(rank) (rsLoRA)": "return x @ weight.T + alpha / rank**0.5 * (x @ lora_A.T) @ lora_B.T",
        "the adapter alone, no frozen layer": "return (alpha / rank) * (x @ lora_A.T) @ lora_B.T",
    },
    "07_async_vs_sync": {
        "ignores concurrency": "return (eta + version + 1) * batch_size - (accepted + running)",
        "ignores staleness": "return max_concurrent - running",
        "leaves running out of the staleness term": (
            "return min(max_concurrent - running, (eta + version + 1) * batch_size - accepted)"
        ),
    },
    "11_environment": {
        "count says 0 for a fruit that is not there": warehouse(count="return str(self.stock.get(fruit, 0))"),
        "count raises KeyError, not ValueError": warehouse(count="return str(self.stock[fruit])"),
        "count's error does not say what there is": warehouse(
            count="""
                if fruit not in self.stock:
                    raise ValueError(f"there are no {fruit} here")
                return str(self.stock[fruit])
            """
        ),
        "rewards the amount of the first fruit in stock": warehouse(
            get_reward="return 1.0 if self.reported == next(iter(self.stock.values())) else 0.0"
        ),
        "rewards the largest amount": warehouse(
            get_reward="return 1.0 if self.reported == max(self.stock.values()) else 0.0"
        ),
        "rewards the amount counted last, not the one asked about": warehouse(
            count="""
                if fruit not in self.stock:
                    raise ValueError(f"there are no {fruit} here; there are {', '.join(self.stock)}")
                self.counted = self.stock[fruit]
                return str(self.counted)
            """,
            get_reward="return 1.0 if self.reported == getattr(self, 'counted', None) else 0.0",
        ),
        "report does not end the episode": warehouse(
            report="""
                self.reported = number
                return "reported"
            """
        ),
        "any report pays": warehouse(get_reward="return 1.0 if self.reported is not None else 0.0"),
        "counting the fruit asked about records it as the answer": warehouse(
            count="""
                if fruit not in self.stock:
                    raise ValueError(f"no {fruit}; there are {', '.join(self.stock)}")
                if fruit == self.asked:
                    self.reported = self.stock[fruit]
                return str(self.stock[fruit])
            """
        ),
        "report ignores its number: pays for having counted the right fruit": warehouse(
            count="""
                if fruit not in self.stock:
                    raise ValueError(f"no {fruit}; there are {', '.join(self.stock)}")
                self.counted = fruit
                return str(self.stock[fruit])
            """,
            get_reward="return 1.0 if self.reported is not None and getattr(self, 'counted', None) == self.asked "
            "else 0.0",
        ),
        "count's error names every fruit there could be, not the stock": warehouse(
            count="""
                if fruit not in self.stock:
                    raise ValueError(f"unknown fruit {fruit}; choose one of {', '.join(FRUITS)}")
                return str(self.stock[fruit])
            """
        ),
        "records the number as text": warehouse(
            report="""
                self.reported = str(number)
                self.done = True
                return "reported"
            """
        ),
        "the answers in a class attribute, which reset does not clear": warehouse(
            report="""
                type(self).answers = getattr(type(self), "answers", []) + [number]
                self.done = True
                return "reported"
            """,
            get_reward="return 1.0 if self.stock[self.asked] in type(self).answers else 0.0",
        ),
        "pays only after counting the fruit asked about": warehouse(
            count="""
                if fruit not in self.stock:
                    raise ValueError(f"no {fruit}; there are {', '.join(self.stock)}")
                self.checked = getattr(self, "checked", set()) | {fruit}
                return str(self.stock[fruit])
            """,
            get_reward="return 1.0 if self.asked in getattr(self, 'checked', set()) and "
            "self.reported == self.stock[self.asked] else 0.0",
        ),
        "pays any number up to the amount": warehouse(
            get_reward="return 1.0 if self.reported is not None and self.reported <= self.stock[self.asked] else 0.0"
        ),
        "the answers in an attribute that reset does not clear": warehouse(
            report="""
                self.answers = getattr(self, "answers", []) + [number]
                self.done = True
                return "reported"
            """,
            get_reward="return 1.0 if self.stock[self.asked] in getattr(self, 'answers', []) else 0.0",
        ),
    },
}

# Right bodies written another way, by notebook: the check must accept them (a check that refuses a right answer
# teaches a rule that is not there: one way of writing it).
RIGHT = {
    "02_rewards_and_tools": {
        "counts by hand with a dict": """
            if not pred_tokens or not gold_tokens:
                return float(pred_tokens == gold_tokens)
            left = {}
            for token in gold_tokens:
                left[token] = left.get(token, 0) + 1
            common = 0
            for token in pred_tokens:
                if left.get(token, 0) > 0:
                    left[token] -= 1
                    common += 1
            if common == 0:
                return 0.0
            precision, recall = common / len(pred_tokens), common / len(gold_tokens)
            return 2 * precision * recall / (precision + recall)
        """,
        "the smaller count of each shared token": f1_counting(
            "sum(min(pred_tokens.count(t), gold_tokens.count(t)) for t in set(pred_tokens))"
        ),
        "F1 as 2 common / (|pred| + |gold|)": """
            if not pred_tokens and not gold_tokens:
                return 1.0
            common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
            return 2 * common / (len(pred_tokens) + len(gold_tokens)) if common else 0.0
        """,
    },
    "06_multiturn_feedback": {
        "sums the discounted rewards that follow": """
            for k in range(len(rewards)):
                returns[k] = sum(gamma ** (j - k) * rewards[j] for j in range(k, len(rewards)))
        """,
        "recursion": """
            def following(k):
                return 0.0 if k == len(rewards) else rewards[k] + gamma * following(k + 1)

            returns = [following(k) for k in range(len(rewards))]
        """,
        "a tensor: a discount matrix times the rewards": """
            import torch

            k = torch.arange(len(rewards), dtype=torch.float64)
            power = k.view(1, -1) - k.view(-1, 1)  # j - k
            discount = torch.where(power >= 0, gamma ** power.clamp(min=0), 0.0)
            returns = discount @ torch.tensor(rewards, dtype=torch.float64)
        """,
    },
    "09_openai_agent": {
        "sums the discounted rewards that follow": """
            for i in range(len(rewards)):
                discounted[i] = sum(turn_discount ** (j - i) * (rewards[j] or 0.0) for j in range(i, len(rewards)))
        """,
        "recursion": """
            def following(i):
                return 0.0 if i == len(rewards) else (rewards[i] or 0.0) + turn_discount * following(i + 1)

            discounted = [following(i) for i in range(len(rewards))]
        """,
        "a numpy array": """
            import numpy as np

            discounted = np.zeros(len(rewards))
            following = 0.0
            for i in reversed(range(len(rewards))):
                following = (rewards[i] or 0.0) + turn_discount * following
                discounted[i] = following
        """,
    },
    "12_judge": {
        "a Counter, without the counts that stay 0": """
            from collections import Counter

            counts = Counter()
            for i in range(len(truth)):
                for j in range(i + 1, len(truth)):
                    if truth[i] != truth[j]:
                        same = (judged[i] - judged[j]) * (truth[i] - truth[j])
                        counts["agree" if same > 0 else "disagree" if same < 0 else "tie"] += 1
        """,
        "itertools.combinations": """
            import itertools

            for (ji, ti), (jj, tj) in itertools.combinations(zip(judged, truth), 2):
                if ti != tj:
                    same = (ji - jj) * (ti - tj)
                    counts["agree" if same > 0 else "disagree" if same < 0 else "tie"] += 1
        """,
        "numpy signs": """
            import numpy as np

            for i in range(len(truth)):
                for j in range(i + 1, len(truth)):
                    t = np.sign(truth[i] - truth[j])
                    if t:
                        d = np.sign(judged[i] - judged[j])
                        counts["tie" if d == 0 else "agree" if d == t else "disagree"] += 1
        """,
        "the right answer first, then the comparison": """
            for i in range(len(truth)):
                for j in range(i + 1, len(truth)):
                    if truth[i] == truth[j]:
                        continue
                    better, worse = (i, j) if truth[i] > truth[j] else (j, i)
                    if judged[better] > judged[worse]:
                        counts["agree"] += 1
                    elif judged[better] < judged[worse]:
                        counts["disagree"] += 1
                    else:
                        counts["tie"] += 1
        """,
    },
    "10_lora": {
        "the merged weight, as the server computes with": "return x @ (weight + (alpha / rank) * lora_B @ lora_A).T",
        "x (BA)^T": "return x @ weight.T + (alpha / rank) * x @ (lora_B @ lora_A).T",
        "F.linear, scaled last": """
            import torch.nn.functional as F

            return F.linear(x, weight) + F.linear(F.linear(x, lora_A), lora_B) * (alpha / rank)
        """,
    },
    "07_async_vs_sync": {
        "the staleness term first": (
            "return min((eta + version + 1) * batch_size - accepted - running, max_concurrent - running)"
        ),
        "running subtracted once, from the smaller limit": (
            "return min(max_concurrent, (eta + version + 1) * batch_size - accepted) - running"
        ),
        "if / else instead of min": """
            free = max_concurrent - running
            headroom = (eta + version + 1) * batch_size - (accepted + running)
            return free if free < headroom else headroom
        """,
    },
    "11_environment": {
        "count returns an int": warehouse(
            count="""
                if fruit not in self.stock:
                    raise ValueError(f"no {fruit}: there are {sorted(self.stock)}")
                return self.stock[fruit]
            """
        ),
        "count with stock.get": warehouse(
            count="""
                amount = self.stock.get(fruit)
                if amount is None:
                    raise ValueError(f"no {fruit} here; there are {', '.join(self.stock)}")
                return str(amount)
            """
        ),
        "count turns the KeyError into a ValueError": warehouse(
            count="""
                try:
                    return f"{self.stock[fruit]}"
                except KeyError:
                    raise ValueError(f"no {fruit}; try one of {list(self.stock)}") from None
            """
        ),
        "count raises a ValueError of its own kind": warehouse(
            count="""
                class NotInStock(ValueError):
                    pass

                if fruit not in self.stock:
                    raise NotInStock(f"no {fruit} here; the warehouse has {', '.join(self.stock)}")
                return str(self.stock[fruit])
            """
        ),
        "get_reward with if / else": warehouse(
            get_reward="""
                if self.reported is not None and self.reported == self.stock[self.asked]:
                    return 1.0
                else:
                    return 0.0
            """
        ),
        "get_reward as float of the comparison": warehouse(
            get_reward="return float(self.reported == self.stock[self.asked])"
        ),
        "report also keeps every report, in a list made on first use": warehouse(
            report="""
                if not hasattr(self, "reports"):
                    self.reports = []
                self.reports.append(number)
                self.reported, self.done = number, True
                return "reported"
            """
        ),
    },
}

# The search agent's loop is long; its wrong versions are the solution with a few lines changed.
WRONG_SEARCH_LOOP = {
    "appends each output twice": [
        ("ids += resp.output_tokens", "ids += resp.output_tokens * 2"),
        ("loss_mask += [1] * len(resp.output_tokens)", "loss_mask += [1] * 2 * len(resp.output_tokens)"),
        ("logprobs += resp.output_logprobs", "logprobs += resp.output_logprobs * 2"),
        ("versions += resp.output_versions", "versions += resp.output_versions * 2"),
    ],
    "trains on the information block": [("loss_mask += [0] * len(info)", "loss_mask += [1] * len(info)")],
    "re-tokenizes the output": [
        ("ids += resp.output_tokens", "ids += self.encode(self.tokenizer.decode(resp.output_tokens))")
    ],
    "goes on after an output without a tag": [
        ("if query is None:\n                break", "if query is None:\n                continue")
    ],
    "hard-codes topk=1": [("topk=self.topk", "topk=1")],
    "reads the global TOPK": [("topk=self.topk", "topk=TOPK")],
    "sends no gconfig": [
        ("ModelRequest(input_ids=list(ids), gconfig=self.gconfig)", "ModelRequest(input_ids=list(ids))")
    ],
    "multiset F1": [('data["answer"], mode="set")', 'data["answer"], mode="multiset")')],
    "exact match instead of F1": [('f1_score(answer, data["answer"], mode="set")', 'float(answer in data["answer"])')],
    "reward 1 for any answer": [('f1_score(answer, data["answer"], mode="set")', "1.0")],
    "scores the first gold answer only": [('data["answer"], mode="set")', 'data["answer"][0], mode="set")')],
    "scores the last gold answer only": [('data["answer"], mode="set")', 'data["answer"][-1], mode="set")')],
    "searches the question, not the model's query": [
        ("call_search_tool([query]", 'call_search_tool([data["question"]]')
    ],
}
RIGHT_SEARCH_LOOP = {
    "grows the lists with extend": [
        ("ids += resp.output_tokens", "ids.extend(resp.output_tokens)"),
        ("loss_mask += [1] * len(resp.output_tokens)", "loss_mask.extend([1] * len(resp.output_tokens))"),
        ("logprobs += resp.output_logprobs", "logprobs.extend(resp.output_logprobs)"),
        ("versions += resp.output_versions", "versions.extend(resp.output_versions)"),
    ],
    "new lists for the information block": [
        ("ids += info", "ids = ids + info"),
        ("loss_mask += [0] * len(info)", "loss_mask = loss_mask + [0 for _ in info]"),
    ],
}


def exercise(name: str, index: int = 0) -> tuple[str, str, str]:
    """(imports, solution cell, check cell) of exercise `index` (counted from 0) in notebook `name`."""
    cells = code_cells(name)
    at = [i for i, source in enumerate(cells) if REGION.search(source)][index]
    assert cells[at + 1].startswith("# CHECK"), f"{name}: exercise {index} is not followed by its check"
    return imports(cells[0]), cells[at], cells[at + 1]


def imports(source: str) -> str:
    """The import statements of a cell: the first cell of a notebook may also load its config or start servers."""
    tree = ast.parse(source)
    return "\n".join(ast.unparse(node) for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom)))


def with_body(source: str, body: str | list[str]) -> str:
    """`source` with its solution region replaced by `body` (indented like the region); a list replaces the first
    regions in order, one body each."""
    for one in [body] if isinstance(body, str) else body:
        region = REGION.search(source)
        new = textwrap.indent(textwrap.dedent(one).strip("\n"), region.group("indent"))
        source = source[: region.start()] + new + source[region.end() :]
    return source


def with_edits(source: str, edits: list[tuple[str, str]]) -> str:
    for old, new in edits:
        assert source.count(old) == 1, f"the solution no longer contains {old!r} once: update this test"
        source = source.replace(old, new)
    return source


def run(ns: dict, *sources: str) -> None:
    """Run cells in `ns` as a notebook would (top-level `await` allowed)."""
    for source in sources:
        code = compile(source, "<cell>", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        if code.co_flags & inspect.CO_COROUTINE:
            asyncio.run(eval(code, ns))
        else:
            exec(code, ns)


def assert_accepted(ns: dict, *sources: str) -> None:
    """The last cell (a check) must pass every case and say so."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        run(ns, *sources)
    assert re.search(r"^all \d+ cases pass$", out.getvalue(), re.M) and "FAIL" not in out.getvalue(), out.getvalue()


def assert_rejected(ns: dict, *sources: str) -> None:
    """The last cell (a check) must print a FAIL line, then raise AssertionError naming expected and got."""
    out = io.StringIO()
    with pytest.raises(AssertionError) as err, contextlib.redirect_stdout(out):
        run(ns, *sources)
    assert "expected" in str(err.value) and "got" in str(err.value), str(err.value)
    assert "FAIL" in out.getvalue(), out.getvalue()


# ---------------------------------------------------------------------------------------------- 02, 06, 07


@pytest.mark.parametrize("name", sorted(WRONG))
def test_check_accepts_the_solution(name):
    imports, solution, check = exercise(name)
    assert_accepted({}, imports, solution, check)


@pytest.mark.parametrize("name,mistake", [(n, m) for n in sorted(WRONG) for m in WRONG[n]])
def test_check_rejects_a_wrong_solution(name, mistake):
    imports, solution, check = exercise(name)
    assert_rejected({}, imports, with_body(solution, WRONG[name][mistake]), check)


@pytest.mark.parametrize("name,variant", [(n, v) for n in sorted(RIGHT) for v in RIGHT[n]])
def test_check_accepts_a_right_variant(name, variant):
    imports, solution, check = exercise(name)
    assert_accepted({}, imports, with_body(solution, RIGHT[name][variant]), check)


def test_every_exercise_is_tested():
    """Every exercise of every notebook has wrong solutions to reject and right variants to accept in this file
    (WRONG and RIGHT try a notebook's first one only). Where one cell holds several solution regions (03's advantages
    and loss), each region is changed by at least one wrong and one right version."""
    sources = glob.glob(os.path.join(ROOT, "notebooks", "src", "*.nb.md"))
    names = [os.path.basename(p)[: -len(".nb.md")] for p in sources]
    exercises = {n: len([c for c in code_cells(n) if REGION.search(c)]) for n in names}
    for kind, tested in [
        ("wrong solutions to reject", {**{n: 1 for n in WRONG}, AGENT: len(WRONG_AGENT), SEARCH: 1}),
        ("right variants to accept", {**{n: 1 for n in RIGHT}, AGENT: len(RIGHT_AGENT), SEARCH: 1}),
    ]:
        untested = {n: k for n, k in sorted(exercises.items()) if k and tested.get(n) != k}
        assert not untested, f"exercises (by notebook) without {kind} in this file: {untested}"
    assert WRONG_SEARCH_LOOP and RIGHT_SEARCH_LOOP
    for name, wrong, right in [
        (AGENT, WRONG_AGENT, RIGHT_AGENT),
        (SEARCH, {0: WRONG_SEARCH_LOOP}, {0: RIGHT_SEARCH_LOOP}),
    ]:
        for index in range(exercises[name]):
            for region in REGION.finditer(exercise(name, index)[1]):
                for kind, versions in [("wrong", wrong[index]), ("right", right[index])]:
                    edited = [old for edits in versions.values() for old, _ in edits if old in region.group(0)]
                    assert edited, f"{name}, exercise {index}: no {kind} version changes {region.group(0)[:80]!r}"


# ---------------------------------------------------------------------------------------------- 05: the turn loop

SEARCH = "05_search_agent"
CORPUS = [
    {"id": "0", "title": "France", "contents": "Paris is the capital of France."},
    {"id": "1", "title": "Peru", "contents": "Lima is the capital of Peru."},
    {"id": "2", "title": "Kenya", "contents": "Nairobi is the capital of Kenya."},
]


@pytest.fixture(scope="module")
def search_ns(tiny_model_path, tmp_path_factory):
    """What the notebook has defined by its exercise: config, tokenizer, prompt, retrieval server, scripted engine."""
    from transformers import AutoTokenizer

    from areal_lite import GenerationHyperparameters, launch_rag_server

    corpus = tmp_path_factory.mktemp("rag") / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in CORPUS))
    rag = launch_rag_server(str(corpus))
    rag.wait_ready(timeout=120)
    cells = code_cells(SEARCH)
    engine_cell = next(c for c in cells if "class ScriptedEngine" in c)
    ns = {
        "tokenizer": AutoTokenizer.from_pretrained(tiny_model_path),
        # the CPU profile's settings (configs/search_agent.yaml)
        "config": SimpleNamespace(
            gconfig=GenerationHyperparameters(
                n_samples=4, max_new_tokens=24, temperature=1.0, stop=["</search>", "</answer>"]
            ),
            max_turns=3,
        ),
        "PROMPT": "Question: {question}\nAnswer:",
        "TOPK": 1,
        "rag": rag,
    }
    run(ns, imports(cells[0]), engine_cell)
    yield ns
    rag.stop()


def test_search_loop_check_accepts_the_solution(search_ns):
    _, solution, check = exercise(SEARCH)
    assert_accepted(dict(search_ns), solution, check)


@pytest.mark.parametrize("mistake", sorted(WRONG_SEARCH_LOOP))
def test_search_loop_check_rejects_a_wrong_loop(search_ns, mistake):
    _, solution, check = exercise(SEARCH)
    assert_rejected(dict(search_ns), with_edits(solution, WRONG_SEARCH_LOOP[mistake]), check)


@pytest.mark.parametrize("variant", sorted(RIGHT_SEARCH_LOOP))
def test_search_loop_check_accepts_a_right_variant(search_ns, variant):
    _, solution, check = exercise(SEARCH)
    assert_accepted(dict(search_ns), with_edits(solution, RIGHT_SEARCH_LOOP[variant]), check)


# ---------------------------------------------------------------------------------------------- 03: the agent
# Four exercises in order: RLVR workflow, reflection workflow, grouped wrapper, advantages + loss. Each check compares
# the learner's code with the package's; here the server is a scripted engine (real ModelResponses, replies in turn,
# a short sleep so that concurrent episodes really overlap) and the trainer an FSDPPPOActor that
# only computes advantages.

WRONG_AGENT = {
    0: {  # MyRLVRWorkflow
        "trains on the prompt": [
            (
                '"loss_mask": torch.tensor([[0] * n + [1] * len(out)]',
                '"loss_mask": torch.tensor([[1] * n + [1] * len(out)]',
            )
        ],
        "tags the prompt with version 0": [("[[-1] * n + resp.output_versions]", "[[0] * n + resp.output_versions]")],
        "sends no gconfig": [("input_ids=list(ids), gconfig=self.gconfig,", "input_ids=list(ids),")],
        # caught only by the check's spelled answers: a sampled answer usually re-encodes to its own ids
        "re-tokenizes the output": [
            (
                "out, n = resp.output_tokens, len(ids)",
                "out = self.tokenizer(self.tokenizer.decode(resp.output_tokens), add_special_tokens=False)"
                '["input_ids"]\n        n = len(ids)',
            )
        ],
    },
    1: {  # MyReflectionWorkflow
        "does not close the assistant turn": [("glue = closing + self.reflection_turn", "glue = self.reflection_turn")],
        "trains on the reflection turn": [("loss_mask + [0] * len(glue)", "loss_mask + [1] * len(glue)")],
        "forgets the discount": [("reward *= self.turn_discount ** turn", "reward *= 1.0")],
        "sends no gconfig": [("input_ids=list(ids), gconfig=self.gconfig,", "input_ids=list(ids),")],
        # caught only by the check's spelled answers: the next turn's context built from the decoded text
        "re-tokenizes the output": [
            (
                "out = resp.output_tokens\n",
                "out = self.tokenizer(self.tokenizer.decode(resp.output_tokens), add_special_tokens=False)"
                '["input_ids"]\n',
            )
        ],
        # caught only by the check's scripted right first answer: the fixture's server is wrong first, right second
        "goes on after a right answer": [("if reward > 0:\n                break", "pass")],
        # caught only by the check's scripted answers: the fixture's server answers never end with EOS
        "always appends the full end of turn": [
            (
                "closing = self.end_of_turn[1:] if out and out[-1] == self.end_of_turn[0] else self.end_of_turn",
                "closing = self.end_of_turn",
            )
        ],
        # the opposite: a cut-off answer (the check's scripted one, and the fixture's) is never closed
        "never appends the first token of the end of turn": [
            (
                "closing = self.end_of_turn[1:] if out and out[-1] == self.end_of_turn[0] else self.end_of_turn",
                "closing = self.end_of_turn[1:]",
            )
        ],
    },
    2: {  # MyGroupedWorkflow
        "runs the episodes one after another": [
            (
                "await asyncio.gather(*(self.workflow.arun_episode(engine, data) for _ in range(self.group_size)))",
                "[await self.workflow.arun_episode(engine, data) for _ in range(self.group_size)]",
            )
        ],
        "keeps one episode": [("return concat_padded_tensors(list(episodes))", "return episodes[0]")],
        "hard-codes the group size": [("for _ in range(self.group_size)", "for _ in range(4)")],
        # caught only by the check's scripted answers of two lengths: the fixture's replies are of one length
        "stacks the rows without padding": [
            (
                "return concat_padded_tensors(list(episodes))",
                "return {k: torch.cat([e[k] for e in episodes]) for k in episodes[0]}",
            )
        ],
    },
    3: {  # my_grpo_advantages and my_ppo_loss
        "the batch mean instead of the group's": [("(r - r.mean(1, keepdim=True))", "(r - r.mean())")],
        "the batch std instead of the group's": [("r.std(1, keepdim=True)", "r.std()")],
        "no eps in the group std": [("(r.std(1, keepdim=True) + eps)", "r.std(1, keepdim=True)")],
        "batch normalisation over the rows, not the tokens": [
            (
                "return torch.where(m, (adv - adv[m].mean()) / (adv[m].std() + eps), 0.0).float()",
                "return torch.where(m, (a - a.mean()) / (a.std() + eps), 0.0).float()",
            )
        ],
        "batch normalisation over every position, padding and prompt included": [
            ("(adv - adv[m].mean()) / (adv[m].std() + eps)", "(adv - adv.mean()) / (adv.std() + eps)")
        ],
        "a population std in the batch normalisation": [("(adv[m].std() + eps)", "(adv[m].std(unbiased=False) + eps)")],
        "no batch normalisation": [
            ("return torch.where(m, (adv - adv[m].mean()) / (adv[m].std() + eps), 0.0).float()", "return adv.float()")
        ],
        "min instead of max": [("surrogate = torch.maximum(", "surrogate = torch.minimum(")],
        "no behaviour weight": [
            ("behaviour_weight = torch.exp(prox_logp - behav_logp).detach()", "behaviour_weight = 1.0")
        ],
        "no clip": [("ratio.clamp(1 - eps_clip, 1 + eps_clip)", "ratio")],
        "no mask in the sum": [
            (
                "return (surrogate * behaviour_weight * loss_mask).sum() / loss_mask.sum()",
                "return (surrogate * behaviour_weight).sum() / loss_mask.sum()",
            )
        ],
    },
}
# Right answers written another way: the check must accept them.
RIGHT_AGENT = {
    0: {  # MyRLVRWorkflow
        "masks and reward from torch.full and torch.cat": [
            (
                '"attention_mask": torch.ones(1, n + len(out), dtype=torch.bool),',
                '"attention_mask": torch.full((1, n + len(out)), True),',
            ),
            (
                '"loss_mask": torch.tensor([[0] * n + [1] * len(out)], dtype=torch.int32),',
                '"loss_mask": torch.cat([torch.zeros(1, n), torch.ones(1, len(out))], dim=1).int(),',
            ),
            (
                '"rewards": torch.tensor([float(reward)], dtype=torch.float32),',
                '"rewards": torch.full((1,), reward, dtype=torch.float32),',
            ),
        ],
        "the prompt read back from the response": [
            ("out, n = resp.output_tokens, len(ids)", "out, n = resp.output_tokens, len(resp.input_tokens)"),
            ('"input_ids": torch.tensor([ids + out]', '"input_ids": torch.tensor([list(resp.input_tokens) + out]'),
        ],
    },
    1: {  # MyReflectionWorkflow
        "drops the EOS by slicing": [
            (
                "closing = self.end_of_turn[1:] if out and out[-1] == self.end_of_turn[0] else self.end_of_turn",
                "closing = self.end_of_turn[1 if out[-1:] == self.end_of_turn[:1] else 0 :]",
            )
        ],
        # the engine's own word for an answer cut off by the token budget, where the solution looks at the last token
        "tells a cut-off answer by its stop_reason": [
            (
                "closing = self.end_of_turn[1:] if out and out[-1] == self.end_of_turn[0] else self.end_of_turn",
                'closing = self.end_of_turn if resp.stop_reason == "length" else self.end_of_turn[1:]',
            )
        ],
        "grows the lists in place": [
            (
                "logprobs, versions = logprobs + [0.0] * len(glue), versions + [-1] * len(glue)",
                "logprobs += [0.0] * len(glue); versions += [-1] * len(glue)",
            ),
            (
                "logprobs, versions = logprobs + resp.output_logprobs, versions + resp.output_versions",
                "logprobs.extend(resp.output_logprobs); versions.extend(resp.output_versions)",
            ),
        ],
    },
    2: {  # MyGroupedWorkflow: any way of running the G episodes at once
        # a dict's key order is the learner's: the check pairs a group's rows by content, read in one fixed order
        "the tensors in another key order": [
            (
                "return concat_padded_tensors(list(episodes))",
                "return dict(reversed(list(concat_padded_tensors(list(episodes)).items())))",
            )
        ],
        "tasks created first, then awaited in turn": [
            (
                "episodes = await asyncio.gather(*(self.workflow.arun_episode(engine, data)"
                " for _ in range(self.group_size)))",
                "tasks = [asyncio.create_task(self.workflow.arun_episode(engine, data))"
                " for _ in range(self.group_size)]"
                "\n        episodes = [await task for task in tasks]",
            )
        ],
        "in the order they finish (asyncio.as_completed): a group is a set": [
            (
                "episodes = await asyncio.gather(*(self.workflow.arun_episode(engine, data)"
                " for _ in range(self.group_size)))",
                "episodes = [await done for done in asyncio.as_completed("
                "[self.workflow.arun_episode(engine, data) for _ in range(self.group_size)])]",
            )
        ],
        "asyncio.TaskGroup": [
            (
                "episodes = await asyncio.gather(*(self.workflow.arun_episode(engine, data)"
                " for _ in range(self.group_size)))",
                "async with asyncio.TaskGroup() as group:"
                "\n            tasks = [group.create_task(self.workflow.arun_episode(engine, data))"
                " for _ in range(self.group_size)]"
                "\n        episodes = [task.result() for task in tasks]",
            )
        ],
    },
    3: {  # my_grpo_advantages and my_ppo_loss
        # the batch normalisation cancels the factor between the two stds (up to eps: within the tolerance)
        "a population std in the group normalisation": [
            ("r.std(1, keepdim=True)", "r.std(1, keepdim=True, unbiased=False)")
        ],
        "group statistics from sums": [
            (
                "a = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps)).view(-1, 1)",
                "d = r - r.sum(1, keepdim=True) / group_size"
                "\n    a = (d / (((d**2).sum(1, keepdim=True) / (group_size - 1)).sqrt() + eps)).view(-1, 1)",
            )
        ],
        "batch statistics from torch.std_mean": [
            (
                "(adv - adv[m].mean()) / (adv[m].std() + eps)",
                "(adv - torch.std_mean(adv[m])[1]) / (torch.std_mean(adv[m])[0] + eps)",
            )
        ],
        "minus the min of the two objectives": [
            (
                "surrogate = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - eps_clip, 1 + eps_clip))",
                "surrogate = -torch.minimum(advantages * ratio,"
                " advantages * torch.clamp(ratio, 1 - eps_clip, 1 + eps_clip))",
            )
        ],
        "the mean over the generated tokens by indexing": [
            (
                "return (surrogate * behaviour_weight * loss_mask).sum() / loss_mask.sum()",
                "return (surrogate * behaviour_weight)[m].mean()",
            )
        ],
    },
}
AGENT = "03_gsm8k_agent"
REPLIES = ["The answer is 7.", "The answer is 5."]  # a wrong first answer, a right second one (gold: 5)
AGENT_ROWS = [
    {"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"},
    {"question": "What is 1 + 4?", "answer": "1 + 4 = 5\n#### 5"},
]


class ScriptedReplies:
    """An engine whose answers are REPLIES in turn, as real ModelResponses, cut off by the token budget (no EOS):
    so the checks' own scripted answers must catch what only an answer ended by EOS shows (03's reflection)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, 0

    async def agenerate(self, req):
        await asyncio.sleep(0.01)  # let concurrent episodes overlap, as on a server
        text = REPLIES[self.calls % len(REPLIES)]
        self.calls += 1
        out = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ModelResponse(
            input_tokens=list(req.input_ids),
            output_tokens=out,
            output_logprobs=[-0.5] * len(out),
            output_versions=[0] * len(out),
            stop_reason="length",  # as the engine reports an answer the token budget cut off
        )


def _definitions(source: str, names: set[str]) -> str:
    """Only the top-level functions and assignments of a cell that define `names` (a cell may also start servers)."""
    keep = []
    for node in ast.parse(source).body:
        defined = (
            {node.name}
            if isinstance(node, (ast.FunctionDef, ast.ClassDef))
            else {t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)}
        )
        if defined & names:
            keep.append(ast.unparse(node))
    return "\n\n".join(keep)


@pytest.fixture(scope="module")
def agent_ns(smollm_path):
    """What notebook 03 has defined before its first exercise, with the scripted engine and a small actor."""
    import torch

    from areal_lite import FSDPPPOActor, GenerationHyperparameters, NormConfig, PPOActorConfig, load_tokenizer
    from areal_lite.reward.arithmetic import arithmetic_reward_fn

    G = 4  # the CPU profile's settings (configs/gsm8k_grpo.yaml)
    cells = code_cells(AGENT)
    tokenizer = load_tokenizer(smollm_path)
    # section 3's grouped batch: two groups of four rows, 3 prompt tokens then 1 to 5 generated, right-padded
    generated = torch.tensor([4, 2, 5, 3, 1, 4, 2, 3])
    position = torch.arange(8)
    attention_mask = position < 3 + generated.view(-1, 1)
    loss_mask = (attention_mask & (position >= 3)).int()
    logprobs = -torch.rand(8, 8, generator=torch.Generator().manual_seed(1)) * loss_mask
    ns = {
        "tokenizer": tokenizer,
        "config": SimpleNamespace(
            gconfig=GenerationHyperparameters(n_samples=G, max_new_tokens=24, temperature=0.8),
            actor=SimpleNamespace(eps_clip=0.2),
        ),
        "rows": AGENT_ROWS,
        "reward_fn": arithmetic_reward_fn,  # the data cell's choice for the CPU profile's arithmetic
        "data": itertools.repeat(AGENT_ROWS),  # endless, as the notebook's `cycle_dataloader` is
        "engine": ScriptedReplies(tokenizer),
        "actor": FSDPPPOActor(
            PPOActorConfig(
                group_size=G,
                reward_norm=NormConfig(mean_level="group", std_level="group"),
                adv_norm=NormConfig(mean_level="batch", std_level="batch"),
            )
        ),
        "batch": {
            "input_ids": torch.where(attention_mask, torch.arange(64).view(8, 8) + 10, 0).int(),
            "attention_mask": attention_mask,
            "loss_mask": loss_mask,
            "logprobs": logprobs,
            "rewards": torch.zeros(8),
        },
    }
    setup = [
        imports(cells[0]),
        _definitions(next(c for c in cells if "def chat_ids" in c), {"chat_ids"}),
        next(c for c in cells if c.startswith("REFLECTION")),
        next(c for c in cells if "class Recorder" in c),
    ]
    run(ns, *setup)
    return ns


def _agent_upto(ns: dict, index: int) -> dict:
    """A copy of `ns` after the exercises before `index`, solved and checked, as a learner gets there."""
    ns = dict(ns)
    for k in range(index):
        _, solution, check = exercise(AGENT, k)
        run(ns, solution, check)
    return ns


@pytest.mark.parametrize("index", sorted(WRONG_AGENT))
def test_agent_check_accepts_the_solution(agent_ns, index):
    _, solution, check = exercise(AGENT, index)
    assert_accepted(_agent_upto(agent_ns, index), solution, check)


@pytest.mark.parametrize("index,mistake", [(i, m) for i in sorted(WRONG_AGENT) for m in WRONG_AGENT[i]])
def test_agent_check_rejects_a_wrong_solution(agent_ns, index, mistake):
    _, solution, check = exercise(AGENT, index)
    assert_rejected(_agent_upto(agent_ns, index), with_edits(solution, WRONG_AGENT[index][mistake]), check)


@pytest.mark.parametrize("index,variant", [(i, v) for i in sorted(RIGHT_AGENT) for v in RIGHT_AGENT[i]])
def test_agent_check_accepts_a_right_variant(agent_ns, index, variant):
    _, solution, check = exercise(AGENT, index)
    assert_accepted(_agent_upto(agent_ns, index), with_edits(solution, RIGHT_AGENT[index][variant]), check)


# ---------------------------------------------------------------------------------------------- the helper itself


def test_check_cases_names_the_case_and_where_it_differs(capsys):
    from areal_lite import check_cases

    cases = {"sum": (0.3, 0.1 + 0.2), "rows": ([[1, 2]], [[1, 3]]), "short": ([1, 2], [1])}
    with pytest.raises(AssertionError, match=r"2 of 3 cases fail; first: rows: .*\(at \[0\]\[1\]: expected 2, got 3\)"):
        check_cases(cases)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "ok    sum" and lines[1].startswith("FAIL  rows")
    assert lines[2] == "FAIL  short: expected [1, 2], got [1] (length: expected 2, got 1)"


def test_check_cases_takes_a_right_answer_in_any_array_type(capsys):
    """A learner may return a numpy array, a numpy scalar or a tensor: right values pass, wrong ones still fail."""
    import numpy as np
    import torch

    from areal_lite import check_cases

    check_cases(
        {"array": ([1.0, 0.5], np.array([1.0, 0.5])), "scalar": (2, np.int64(2)), "tensor": ([[1]], torch.ones(1, 1))}
    )
    assert capsys.readouterr().out.splitlines()[-1] == "all 3 cases pass"
    with pytest.raises(AssertionError, match=r"array: expected \[1.0, 0.5\], got \[1.0, 0.25\]"):
        check_cases({"array": ([1.0, 0.5], np.array([1.0, 0.25]))})
