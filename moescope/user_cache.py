"""The user's cache directory, the one place moescope keeps what it can recompute (torch-free):
``$MOESCOPE_CACHE``, else ``$XDG_CACHE_HOME/moescope``, else ``~/.cache/moescope``. Each user of it has a folder
of its own: ``balanced-routers/`` (``runtime.routers_cache``), ``corpus/`` (``runtime.corpus``).

Everything there is a pure function of its key: losing it costs a recomputation, and a file that cannot be read
or written is recomputed or skipped, never an error (a read-only HOME serves as usual).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def root() -> Path:
    return Path(os.environ.get("MOESCOPE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "moescope"))


def write_atomic(path: Path, data: bytes) -> bool:
    """Write ``data`` to ``path`` whole or not at all (a reader in another process never sees half a file);
    False where it could not be written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
        return True
    except OSError:
        return False
