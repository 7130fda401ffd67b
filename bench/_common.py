"""What the benchmark scripts share (a helper module: bench/run_all.py skips names starting with _)."""

from __future__ import annotations

import json
from pathlib import Path


def write_json(path, result, indent: int = 1) -> None:
    """Write a benchmark's result as JSON (its folder made if need be) and say where."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=indent) + "\n")
    print(f"wrote {path}")
