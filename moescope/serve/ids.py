"""Request ids and tenant labels.

A request's id is the key of its row in the trace store, the ``moescope.request_id`` attribute of its
OpenTelemetry span, the ``x-request-id`` response header and the ``id`` of the response body: one string, so
``moescope trace <id>`` opens what a client got back. A client may bring its own id in ``x-request-id``; any
value is accepted. It is the key as it is when it is 1-64 characters of ``[A-Za-z0-9._:-]`` starting with a
letter or digit (safe to store, echo and type on a command line) and not already in flight; otherwise the key is
``distinct(id)``: its safe characters (at most 40) and ``-`` and 8 random hex digits, or 16 fresh hex digits when
nothing of it is safe. The key actually used is what the header and the body's ``id`` echo.

``user`` becomes the request's ``tenant`` label (stored, shown by ``moescope requests``): a short plain label is
kept as it is; any other string is stored as ``u-`` and the first 16 hex digits of its SHA-256, so the store's
label set stays bounded in size and free of control characters, and one user always maps to one label.
"""

from __future__ import annotations

import hashlib
import re
import uuid

_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")
_UNSAFE = re.compile(r"[^A-Za-z0-9._:-]+")
_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+-]{0,63}")
PREFIX_CHARS = 40  # of a sanitised id, before its random suffix


def fresh() -> str:
    """A new id (16 hex digits, as the engine makes)."""
    return uuid.uuid4().hex[:16]


def request_id(header: str | None) -> str:
    """The store key for an incoming ``x-request-id``: the header itself when it is a safe key, a distinct key
    derived from it when it is not, a fresh id when there is none."""
    if header is None or header == "":
        return fresh()
    return header if _ID.fullmatch(header) else distinct(header)


def distinct(header: str) -> str:
    """A safe key derived from ``header`` that no other request has: for an id that is not a safe key, or one
    already in flight."""
    prefix = _UNSAFE.sub("", header)[:PREFIX_CHARS].lstrip("._:-")
    return f"{prefix}-{uuid.uuid4().hex[:8]}" if prefix else fresh()


def tenant(user: str | None) -> str | None:
    """``user`` as a tenant label: itself when it is a short plain label, else ``u-`` + a SHA-256 prefix."""
    if user is None or user == "":
        return None
    if _TENANT.fullmatch(user):
        return user
    return "u-" + hashlib.sha256(user.encode("utf-8", "surrogatepass")).hexdigest()[:16]
