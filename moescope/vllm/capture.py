"""How routing leaves vLLM's compiled forward: the routers' capture functions, bound as the model is built.

vLLM compiles the model's forward (torch.compile; on CPU the fused-MoE layer is traced into the graph): a capture
function bound after compilation is never called, and plain Python in one bound before it would break the graph.
So, as each MoE layer (a ``MoERunner``) is registered into the model being built (torch's module-registration
hook, before any forward or compilation), its router's capture function (``BaseRouter.set_capture_fn``, the slot
vLLM's own routed-experts capturer uses) is set to a closure that calls one custom op, ``moescope::route``. The
graph keeps the op as an opaque call (it marks a per-layer counter as mutated, so it is never dead code), and its
Python body hands the real ``topk_ids`` to the sink the adapter installs on the worker's first step, or does
nothing while there is none (vLLM's start-up forwards). A capture function vLLM binds later (its own capturer) is
chained before ours, never replaced (the router's ``set_capture_fn`` is wrapped on that instance).

A graph compiled with the op must never serve a process without moescope, nor one compiled without it a process
with moescope: while the plugin is configured, vLLM's compile cache is off (``VLLM_DISABLE_COMPILE_CACHE=1``,
set in the plugin's processes before any worker compiles).
"""

from __future__ import annotations

import logging
import weakref
from typing import Callable

import torch

log = logging.getLogger("vllm.moescope")

_SINK: Callable[[int, torch.Tensor], None] | None = None
_RUNNERS: "weakref.WeakValueDictionary[int, torch.nn.Module]" = weakref.WeakValueDictionary()
_hook = None


@torch.library.custom_op("moescope::route", mutates_args=("seen",))
def route(topk_ids: torch.Tensor, seen: torch.Tensor, layer: int) -> None:
    """One MoE layer's chosen experts of one forward: to the sink (never raises into vLLM's forward)."""
    seen.add_(1)
    sink = _SINK
    if sink is not None:
        try:
            sink(layer, topk_ids)
        except Exception:  # the sink counts its own errors; this is the last guard before vLLM's forward
            log.debug("moescope sink failed on layer %d", layer, exc_info=True)


@route.register_fake
def _(topk_ids, seen, layer) -> None:
    return None


def set_sink(sink: Callable[[int, torch.Tensor], None] | None) -> None:
    global _SINK
    _SINK = sink


def runners() -> list[tuple[int, torch.nn.Module]]:
    """(layer, runner) of every MoE layer bound in this process, in layer order."""
    return sorted(_RUNNERS.items())


def bind(runner) -> bool:
    """Set ``runner``'s router's capture function to moescope's (chaining any it has, and any bound later)."""
    router = getattr(runner, "router", None)
    if router is None or not callable(getattr(router, "set_capture_fn", None)) or getattr(router, "_moescope", None):
        return False
    layer = int(runner.layer_id)
    seen = torch.zeros(1, dtype=torch.int64, device=getattr(getattr(runner, "moe_config", None), "device", "cpu"))
    others: list = []
    if router.capture_fn is not None:
        others.append(router.capture_fn)

    def capture(topk_ids: torch.Tensor) -> None:
        for other in others:  # vLLM's own capturer first: ours never changes what it sees
            other(topk_ids)
        torch.ops.moescope.route(topk_ids, seen, layer)

    set_capture_fn = router.set_capture_fn

    def chained(fn) -> None:  # vLLM binding its capturer later: both get the ids
        others.clear()
        if fn is not None:
            others.append(fn)
        set_capture_fn(capture)

    set_capture_fn(capture)
    router.set_capture_fn = chained
    router._moescope = seen
    _RUNNERS[layer] = runner
    return True


def install_hook() -> None:
    """Bind every MoE layer registered into a module from now on in this process (the model vLLM builds)."""
    global _hook
    if _hook is not None:
        return
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    def on_register(module, name, submodule):
        if submodule is not None and isinstance(getattr(submodule, "router", None), BaseRouter) \
                and hasattr(submodule, "layer_name"):
            try:
                bind(submodule)
            except Exception as e:  # noqa: BLE001 (a layer we cannot bind is a log line, not a failed load)
                log.warning("moescope: cannot watch MoE layer %s: %s", getattr(submodule, "layer_name", "?"), e)
        return None

    _hook = torch.nn.modules.module.register_module_module_registration_hook(on_register)
