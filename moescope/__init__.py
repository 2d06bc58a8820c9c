"""moescope: observability and diagnostics for Mixture-of-Experts inference.

Public API (imports are lazy so ``import moescope`` stays light)::

    import moescope
    with moescope.instrument(model, port=9400) as inst:   # reference runtime model or a HF MoE model
        ...                                               # serve; Prometheus scrapes inst.exporter.url
"""

__version__ = "0.1.0"


def instrument(model, **kwargs):
    """Instrument ``model`` (see ``moescope.api.Instrumentation`` for the arguments)."""
    from moescope.api import Instrumentation

    return Instrumentation(model, **kwargs)


__all__ = ["__version__", "instrument"]
