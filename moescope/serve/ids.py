"""Request ids and tenant labels.

A request's id is the key of its row in the trace store, the ``moescope.request_id`` attribute of its
OpenTelemetry span, the ``x-request-id`` response header and the ``id`` of the response body: one string, so
``moescope trace <id>`` opens what a client got back. A client may bring its own id in ``x-request-id``; it
is kept when it is 1-64 characters of ``[A-Za-z0-9._:-]`` starting with a letter or digit (it is stored and
echoed: no spaces, no control characters, bounded), otherwise the server makes a fresh one.

``user`` becomes the request's ``tenant`` label (stored, shown by ``moescope requests``): bounded the same way.
"""

from __future__ import annotations

import re
import uuid

from moescope.serve.errors import APIError

_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")
_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+-]{0,63}")


def request_id(header: str | None) -> str:
    """The incoming id when it is valid, else a fresh one (16 hex digits, as the engine makes)."""
    if header is not None and _ID.fullmatch(header):
        return header
    return uuid.uuid4().hex[:16]


def tenant(user: str | None) -> str | None:
    """``user`` as a tenant label. Raises APIError (400) when it is not a short plain label."""
    if user is None or user == "":
        return None
    if not _TENANT.fullmatch(user):
        raise APIError(400, "user must be 1-64 characters of letters, digits and . _ : @ + - (a tenant label, "
                       "e.g. a hashed user id)", param="user", code="invalid_user")
    return user
