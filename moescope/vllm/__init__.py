"""moescope on vLLM: a plugin that a plain ``vllm serve`` loads (entry point ``moescope`` in vLLM's
``vllm.general_plugins`` group), feeding moescope's metrics, traces, alerts and views from vLLM's own MoE layers.

Inert unless configured by environment variables (docs/vllm.md):

- ``MOESCOPE_METRICS_PORT``: serve moescope's metrics (the same schema as ``moescope demo``) on this port; the
  worker of data-parallel rank r on port + r.
- ``MOESCOPE_METRICS_ADDR``: the address to bind (default 127.0.0.1).
- ``MOESCOPE_TRACES``: per-token traces into this SQLite file, or a Parquet trace lake when it ends in ``/`` or
  is a directory; ``MOESCOPE_TRACE_SAMPLE`` the share of ordinary requests kept (default 0.1; anomalous ones
  always are).
- ``MOESCOPE_MODEL_NAME`` (default: vLLM's served model name), ``MOESCOPE_REPLICA`` (the ``replica`` label),
  ``MOESCOPE_BASELINE`` (a ``moescope baseline save`` file), ``MOESCOPE_WINDOW_S`` (the routing window, 60 s).

Nothing here may harm vLLM: every failure is one log line and a count, and vLLM serves on as without moescope.
"""

from __future__ import annotations

import os


def register() -> None:
    """vLLM's ``vllm.general_plugins`` entry point: run in every vLLM process (API server, engine core, workers),
    possibly more than once. Cheap and inert when nothing is configured."""
    if not (os.environ.get("MOESCOPE_METRICS_PORT") or os.environ.get("MOESCOPE_TRACES")):
        return
    # start-up: an unconfigured vLLM process imports nothing more (tests/test_vllm_plugin.py checks it)
    from moescope.vllm import plugin

    plugin.install()


__all__ = ["register"]
