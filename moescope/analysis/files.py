"""Reading moescope's own JSON files (routing logs, baselines) with one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

from moescope.errors import BadInput


def read_format(path: str | Path, what: str, fmt: str | tuple[str, ...]) -> dict:
    """The JSON object in ``path``, which must carry ``"format": fmt`` (or one of the formats ``fmt`` lists,
    newest first); ``what`` names the file in errors."""
    fmts = (fmt,) if isinstance(fmt, str) else tuple(fmt)
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise BadInput(f"{what} {path} does not exist") from None
    except (OSError, ValueError) as exc:
        raise BadInput(f"{what} {path} is not readable JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("format") not in fmts:
        older = f" (or {', '.join(fmts[1:])})" if len(fmts) > 1 else ""
        raise BadInput(f"{what} {path} is not in {fmts[0]}{older} format")
    return data
