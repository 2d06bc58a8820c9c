"""Ports for the servers a benchmark starts: tests/servers.py ``free_port``, below the kernel's ephemeral range.

A port the OS hands out as free (bind to 0) can become some outgoing connection's source port before the server
binds it (CI: "Address already in use" for one of three servers started together); ports below the ephemeral
range are never handed out that way.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent / "tests"))

from servers import free_port  # noqa: E402

__all__ = ["free_port"]
