"""Where every benchmark writes its figures (the README quotes them from benchmarks/results/)."""

from __future__ import annotations

import json
from pathlib import Path


def save(report, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}")
