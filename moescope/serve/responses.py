"""OpenAI-shaped response bodies and server-sent-event chunks.

The body's ``id`` is the request id itself (also the ``x-request-id`` header and the trace-store key), so
``moescope trace <completion.id>`` works from what an SDK hands back. ``usage`` counts tokens as the trace
store does: the prompt's bytes plus BOS, and every output token including a final EOS.
"""

from __future__ import annotations

import json

from moescope.runtime.engine import RequestRecord

OBJECTS = {"completion": ("text_completion", "text_completion"), "chat": ("chat.completion", "chat.completion.chunk")}


def usage(record: RequestRecord) -> dict:
    prompt, completion = len(record.prompt_tokens), record.n_output
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _choice(kind: str, text: str | None, finish: str | None, *, delta: bool, first: bool = False) -> dict:
    if kind == "completion":
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
    if delta:
        content = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
        return {"index": 0, "delta": content, "logprobs": None, "finish_reason": finish}
    return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish}


def body(kind: str, rid: str, created: int, model: str, text: str, finish: str, record: RequestRecord) -> dict:
    """A whole (non-streaming) response."""
    return {"id": rid, "object": OBJECTS[kind][0], "created": created, "model": model,
            "choices": [_choice(kind, text, finish, delta=False)], "usage": usage(record)}


def chunk(kind: str, rid: str, created: int, model: str, text: str | None = None, finish: str | None = None,
          *, first: bool = False, record: RequestRecord | None = None) -> dict:
    """One streamed chunk; with ``record`` the usage-only chunk (``stream_options.include_usage``)."""
    out = {"id": rid, "object": OBJECTS[kind][1], "created": created, "model": model,
           "choices": [] if record is not None else [_choice(kind, text, finish, delta=True, first=first)]}
    if record is not None:
        out["usage"] = usage(record)
    return out


def sse(obj: dict | str) -> bytes:
    """One server-sent event (``data: [DONE]`` for the string ``"[DONE]"``)."""
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n".encode()
