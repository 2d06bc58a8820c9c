"""CUDA checks (run where a GPU is lent: `pytest -m gpu`). Skipped without CUDA, like megablocks' gpu marker."""

import pytest
import torch

import moescope
from moescope.capture.observer import Observer
from moescope.runtime.model import MoETransformer, Segment

pytestmark = pytest.mark.gpu


class SyncGuard(Observer):
    """Runs the wrapped observer's in-forward hooks with CUDA sync debugging set to raise."""

    def __init__(self, inner):
        self.inner = inner

    def _guarded(self, fn, *args):
        torch.cuda.set_sync_debug_mode("error")
        try:
            fn(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    def on_routing(self, layer, decision):
        self._guarded(self.inner.on_routing, layer, decision)

    def on_layer_time(self, layer, router_s, experts_s):
        self._guarded(self.inner.on_layer_time, layer, router_s, experts_s)

    def on_step(self, step):
        self.inner.on_step(step)  # the interval flush copies to the host by design (once per interval)


def test_capture_hooks_never_sync_and_counts_are_exact_on_cuda(tiny_cfg):
    model = MoETransformer(tiny_cfg).cuda().eval()
    with moescope.instrument(model) as inst:
        model.observer = SyncGuard(inst.observer)
        tokens = torch.randint(0, 256, (64,), device="cuda")
        with torch.no_grad():
            out = model(tokens, [Segment(64)])
        inst.metrics.flush()
        for layer, d in out.decisions.items():
            want = torch.bincount(d.ids.reshape(-1).cpu(), minlength=tiny_cfg.n_experts).tolist()
            assert inst.metrics.expert_tokens[layer].tolist() == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_router_kernel_on_cuda_equals_the_reference():
    pytest.importorskip("triton")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    import triton_router_check

    triton_router_check.main("cuda")
