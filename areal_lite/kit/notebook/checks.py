"""Checks for the notebook exercises: named cases, each with its expected value and the learner's result.

Design decision: an exercise check is a table `{case: (expected, got)}` handed to one function, `check_cases`. It
prints one line per case (so a learner sees what already works), then either a closing "all N cases pass" line or an
`AssertionError` that names the first failing case with its expected and actual values. Raising, rather than printing
True/False, stops a "Run all" at the first wrong exercise and lets a test prove that a check rejects a wrong
solution (tests/test_exercises.py). Every notebook's check has this shape, whatever it compares (F1 scores, lists of
returns, token lists of a trajectory), so the comparison lives here once: numbers match within a tolerance, lists
and tuples element by element, anything else by `==`.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, List, Mapping, Tuple

_SHOWN = 60  # characters of a value shown in a report; a trajectory's token list would fill the screen


def check_cases(cases: Mapping[str, Tuple[Any, Any]], tol: float = 1e-9) -> None:
    """Compare each case's `(expected, got)`, print a line per case, raise `AssertionError` naming the first miss."""
    failures = []
    for name, (expected, got) in cases.items():
        expected, got = _plain(expected), _plain(got)
        if _close(expected, got, tol):
            print(f"ok    {name}")
        else:
            failures.append(f"{name}: {_difference(expected, got, tol)}")
            print(f"FAIL  {failures[-1]}")
    if failures:
        raise AssertionError(f"{len(failures)} of {len(cases)} cases fail; first: {failures[0]}")
    print(f"all {len(cases)} cases pass")


def request_sampling(requests: Iterable[Any]) -> List[Tuple[Any, ...]]:
    """Each request's `(n_samples, max_new_tokens, temperature, greedy, stop)`, from its gconfig (stop strings sorted).

    A workflow's tokens do not show how it asked to sample: a `ModelRequest` built without the workflow's gconfig
    still gets answers, with the defaults (16384 new tokens at temperature 1.0, no stop strings). So a check compares
    this list for the learner's requests with the package workflow's.
    """
    return [
        (g.n_samples, g.max_new_tokens, g.temperature, g.greedy, sorted(g.stop or []))
        for g in (r.gconfig for r in requests)
    ]


def _plain(x: Any) -> Any:
    """numpy arrays and scalars, tensors: the lists and numbers they hold (a right answer passes in any of them)."""
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x] if isinstance(x, list) else tuple(_plain(v) for v in x)
    if not isinstance(x, (str, bytes)) and callable(getattr(x, "tolist", None)):
        return x.tolist()
    return x


def _close(expected: Any, got: Any, tol: float) -> bool:
    if isinstance(expected, (list, tuple)):
        return (
            isinstance(got, (list, tuple))
            and len(got) == len(expected)
            and all(_close(e, g, tol) for e, g in zip(expected, got))
        )
    if _is_number(expected) and _is_number(got):
        return math.isclose(expected, got, rel_tol=tol, abs_tol=tol)
    return expected == got


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _difference(expected: Any, got: Any, tol: float) -> str:
    """Expected and got, shortened, plus where nested lists first differ (the useful part of a long list)."""
    where = _first_difference(expected, got, tol)
    return f"expected {_short(expected)}, got {_short(got)}" + (f" ({where})" if where else "")


def _first_difference(expected: Any, got: Any, tol: float, path: str = "") -> str:
    if not (isinstance(expected, (list, tuple)) and isinstance(got, (list, tuple))):
        return f"at {path}: expected {_short(expected)}, got {_short(got)}" if path else ""
    first = next((i for i, (e, g) in enumerate(zip(expected, got)) if not _close(e, g, tol)), None)
    if first is None:  # one is the other plus more items
        return f"length{' of ' + path if path else ''}: expected {len(expected)}, got {len(got)}"
    return _first_difference(expected[first], got[first], tol, f"{path}[{first}]")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 4] + " ..."
