"""``moescope serve``: an OpenAI-compatible HTTP API on the reference runtime.

Data flow (one concept per module):

- ``protocol``: request bodies (pydantic, strict) -> a validated ``Params``; ``errors``: the OpenAI error
  object every 4xx carries; ``ids``: request ids (``x-request-id``) and tenant labels; ``chat``: the chat
  template over the byte tokenizer.
- ``loop``: one engine thread owns the model and steps continuously (continuous batching: a request joins at
  the next step); handlers hand it jobs through a bounded ``Admission`` queue (full: 429) and receive tokens
  through a per-request ``TokenStream`` the engine fills from its own thread, never waiting on a client.
- ``text``: tokens -> text (incremental UTF-8, stop strings held back and trimmed); ``responses``: the
  OpenAI-shaped bodies and server-sent-event chunks.
- ``app``: the FastAPI application; ``server``: uvicorn with graceful SIGTERM (stop accepting, finish or
  cancel in-flight requests within a deadline, then the caller flushes the trace store).
"""
