"""moescope: observability and diagnostics for Mixture-of-Experts inference.

Public API (imports are lazy so ``import moescope`` stays light)::

    import moescope
    from moescope.config import Metrics, Traces

    cfg = moescope.Config(metrics=Metrics(port=9400), traces=Traces("traces.sqlite"))
    with moescope.instrument(model, cfg) as inst:   # reference runtime model or a HF MoE model
        ...                                        # serve; Prometheus scrapes inst.exporter.url
    with moescope.instrument(model, port=9400):     # shorthand: metrics only
        ...
"""

from moescope.version import __version__


def instrument(model, config=None, **metrics):
    """Instrument ``model`` as ``config`` (``moescope.Config``) says; see ``moescope.api.Instrumentation``."""
    # start-up: every `import moescope.X` runs this file first; moescope.api loads numpy and the sinks' modules
    from moescope.api import Instrumentation

    return Instrumentation(model, config, **metrics)


def __getattr__(name: str):
    if name == "Config":
        from moescope.config import Config  # start-up: `import moescope` loads the version only (see instrument)

        return Config
    raise AttributeError(f"module 'moescope' has no attribute {name!r}")


__all__ = ["__version__", "instrument", "Config"]
