"""How routing leaves vLLM's forward: tensor ops into one preallocated device buffer, nothing a graph replay skips.

On GPUs vLLM runs CUDA graphs by default (piecewise and full decode graphs): a replay runs the recorded kernels
and no Python, so a capture function that hands ``topk_ids`` to Python would run once, at capture, and never
again. On the CPU build the fused-MoE layer is traced into vLLM's torch.compile graph, where a Python side effect
would break the graph or be traced away. So moescope's capture function does exactly what vLLM's own
routed-experts capturer does (``RoutedExpertsCapturer.capture``): one copy of the layer's ``topk_ids`` into its
slot of a buffer allocated before the model is built,

    ids[:T, slot, :] = topk_ids            # T = the forward's rows (padding included), slot = the layer's

which a graph records like any other kernel. The step wrapper (``moescope.vllm.plugin``, outside any graph)
reads the step's real rows, ``ids[:rows, :layers]``, after the forward: one device op per step, never a host
sync (``moescope.vllm.vllm_adapter``). Rows past ``rows`` (a captured graph's padding) are never read.

Binding: as each MoE layer (a ``MoERunner``) is registered into the model being built (torch's
module-registration hook, before any forward or compilation), its router's capture function (``BaseRouter``'s
``set_capture_fn``, the slot vLLM's own capturer uses) is set to moescope's. A capture function vLLM binds later
(its own capturer) is chained before ours, never replaced (the router's ``set_capture_fn`` is wrapped on that
instance). vLLM's monolithic MoE kernels (``routed_experts.routing_sink``) call no router capture function: such
a layer is not counted (one log line).
"""

from __future__ import annotations

import logging
import weakref

import torch

log = logging.getLogger("vllm.moescope")

_RUNNERS: "weakref.WeakValueDictionary[int, torch.nn.Module]" = weakref.WeakValueDictionary()
_hook = None


class StepBuffer:
    """The routed expert ids of the forward in flight, one slot per MoE layer: ``ids`` [rows, slots, k] int32 on
    the model's device, written by the capture functions inside the forward (graph-safe), read by the step
    wrapper after it. ``layers[i]`` is the model layer of slot ``i`` (slots in binding order).

    ``rows`` bounds the rows of one forward (vLLM's ``max_num_batched_tokens``, the size its own capturer
    allocates); a forward with more rows (none in vLLM's own accounting) has its first ``rows`` recorded."""

    def __init__(self, rows: int, slots: int, top_k: int, device) -> None:
        self.ids = torch.zeros((rows, slots, top_k), dtype=torch.int32, device=device)
        self.layers: list[int] = []
        self.top_k = top_k

    def slot(self, layer: int) -> int | None:
        """The slot for ``layer`` (a new one on first use); None when every slot is taken."""
        if layer in self.layers:
            return self.layers.index(layer)
        if len(self.layers) == self.ids.shape[1]:
            return None
        self.layers.append(layer)
        return len(self.layers) - 1

    def step_ids(self, rows: int) -> torch.Tensor:
        """The step's real rows, [rows, L, k] int64, in slot order: a copy (the next forward overwrites the
        buffer), enqueued on the device after the forward that wrote it; no host sync."""
        return self.ids[:rows, :len(self.layers)].to(torch.int64)


_BUFFER: StepBuffer | None = None


def record(ids: torch.Tensor, slot: int, topk_ids: torch.Tensor) -> None:
    """The whole of moescope's work inside vLLM's forward: one copy into the slot (a graph records it; a replay
    re-runs it). Rows past the buffer's are not recorded (never raised into the forward)."""
    n = min(topk_ids.shape[0], ids.shape[0])
    ids[:n, slot].copy_(topk_ids[:n])


def buffer_of(runner) -> StepBuffer | None:
    """The step buffer ``runner``'s capture function writes (None: not bound)."""
    buf = getattr(getattr(runner, "router", None), "_moescope", None)
    return buf if isinstance(buf, StepBuffer) else None


def runners() -> list[tuple[int, torch.nn.Module]]:
    """(layer, runner) of every MoE layer bound in this process, in layer order."""
    return sorted(_RUNNERS.items())


def _sizes(runner) -> tuple[int, int]:
    """(rows, slots) of the step buffer, from the config vLLM builds the model under: ``max_num_batched_tokens``
    rows (what vLLM's own capturer allocates) and the model's hidden layers (an upper bound on its MoE layers)."""
    from vllm.config import get_current_vllm_config  # optional: vllm (only inside a vLLM process)

    cfg = get_current_vllm_config()
    rows = int(cfg.scheduler_config.max_num_batched_tokens)
    slots = int(cfg.model_config.get_total_num_hidden_layers())
    return rows, max(slots, int(runner.layer_id) + 1)


def _process_buffer(runner) -> StepBuffer:
    """The process' step buffer (one model per vLLM worker), allocated at the first MoE layer's binding."""
    global _BUFFER
    if _BUFFER is None:
        rows, slots = _sizes(runner)
        device = getattr(getattr(runner, "moe_config", None), "device", None) or "cpu"
        _BUFFER = StepBuffer(rows, slots, int(runner.moe_config.experts_per_token), device)
    return _BUFFER


def bind(runner, buf: StepBuffer | None = None) -> bool:
    """Set ``runner``'s router's capture function to moescope's (chaining any it has, and any bound later), writing
    into ``buf`` (default: the process' step buffer, sized from the vLLM config the model is built under)."""
    router = getattr(runner, "router", None)
    if router is None or not callable(getattr(router, "set_capture_fn", None)) \
            or getattr(router, "_moescope", None) is not None:
        return False
    layer = int(runner.layer_id)
    buf = buf if buf is not None else _process_buffer(runner)
    slot = buf.slot(layer)
    if slot is None or int(runner.moe_config.experts_per_token) != buf.top_k:
        log.warning("moescope: MoE layer %d not watched (the step buffer has %d slots of top-%d)", layer,
                    buf.ids.shape[1], buf.top_k)
        return False
    ids = buf.ids
    others: list = []
    if router.capture_fn is not None:
        others.append(router.capture_fn)

    def capture(topk_ids: torch.Tensor) -> None:
        for other in others:  # vLLM's own capturer first: ours never changes what it sees
            other(topk_ids)
        record(ids, slot, topk_ids)

    set_capture_fn = router.set_capture_fn

    def chained(fn) -> None:  # vLLM binding its capturer later: both get the ids
        others.clear()
        if fn is not None:
            others.append(fn)
        set_capture_fn(capture)

    set_capture_fn(capture)
    router.set_capture_fn = chained
    router._moescope = buf  # the buffer this layer writes (the adapter reads it)
    _RUNNERS[layer] = runner
    return True


def install_hook() -> None:
    """Bind every MoE layer registered into a module from now on in this process (the model vLLM builds)."""
    global _hook
    if _hook is not None:
        return
    # optional: vllm (only inside a vLLM process)
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
