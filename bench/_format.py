"""How the benches print a spread: "median (lowest-highest)", one format for every bench and for the report."""

from __future__ import annotations

import statistics


def span(median: float, lowest: float, highest: float, fmt: str = "{:.1f}", unit: str = "") -> str:
    """`median` with its range: "m<unit> (lo-hi)"."""
    return f"{fmt.format(median)}{unit} ({fmt.format(lowest)}-{fmt.format(highest)})"


def median_range(values: list[float], fmt: str = "{:.1f}", unit: str = "") -> str:
    """The median of `values` and their range (`span`); "-" when there are none."""
    if not values:
        return "-"
    return span(statistics.median(values), min(values), max(values), fmt, unit)
