"""Test-only: lets vLLM's CPU build run Model Runner V2 (Triton's interpreter runs its kernels on the CPU).

vLLM decides "Triton available" (``vllm.triton_utils.importing.HAS_TRITON``) by the backends Triton registers; the
CPU build accepts Triton only with a "cpu" backend (triton-cpu), which PyPI's Triton lacks, and Model Runner V2
refuses to start without Triton ("Model Runner V2 requires Triton"). With ``TRITON_INTERPRET=1`` every
``@triton.jit`` kernel runs in Triton's interpreter on CPU tensors, so registering an entry named "cpu" (whose
driver says it is active) is all that is missing. A server started with ``PYTHONPATH`` holding this folder,
``TRITON_INTERPRET=1`` and ``VLLM_USE_V2_MODEL_RUNNER=1`` runs Model Runner V2 (its log: "Using V2 Model Runner").
Eager only (``--enforce-eager``): compiled, torch's inductor takes the entry for a real Triton CPU backend and fails
(its driver has no ``get_current_target``). Used by tests/test_vllm.py only; never installed, never part of
moescope.
"""

try:
    import triton.backends as _backends

    class _Driver:
        @staticmethod
        def is_active() -> bool:
            return True

    class _Backend:
        driver = _Driver
        compiler = None

    _backends.backends.setdefault("cpu", _Backend())
except Exception as e:  # noqa: BLE001 (a test shim: say why, and let vLLM decide as without it)
    import sys

    print(f"tests/mrv2/sitecustomize.py: not applied: {e}", file=sys.stderr)
