"""What the rounds-based benches share: a number's median and range, and the result printed as JSON
(and written to `--out` when given)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path


def median_range(values: list[float], digits: int = 4) -> dict:
    """{"median", "range": [min, max]} of `values`, rounded to `digits`."""
    return {
        "median": round(statistics.median(values), digits),
        "range": [round(min(values), digits), round(max(values), digits)],
    }


def emit(result: dict, out: str | Path | None) -> None:
    """Print `result` as JSON; also write it to `out` when given."""
    text = json.dumps(result, indent=1)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
