"""Work counted, not timed: the Python function calls, C calls and torch operations a piece of code makes on the
calling thread. Counts do not move with the machine's load, so a test can assert them (tests/test_step_work.py) and
the cost model (benchmarks/cost_model.py) can print them beside its timings.

    with WorkCount() as w:
        observer.on_step(step)
    w.python, w.c, w.torch_ops

``sys.setprofile`` sees the calling thread only (another thread's work, the evaluator's or a writer's, is not in
the count), and ``torch.overrides.TorchFunctionMode`` sees every torch function and tensor method called from
Python on it.
"""

from __future__ import annotations

import sys
from collections import Counter

from torch.overrides import TorchFunctionMode


# What a torch function mode sees of a read of a tensor's host-side header (a property's ``__get__``: shape, dtype,
# device, is_cuda, ...; and the methods that only read it): no tensor is made, no kernel runs.
METADATA = frozenset({"__get__", "dim", "ndimension", "is_floating_point", "is_complex", "size", "numel",
                      "element_size", "stride", "storage_offset", "is_contiguous", "get_device", "__len__"})


class _Ops(TorchFunctionMode):
    def __init__(self, counter: Counter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.counter[getattr(func, "__name__", str(func))] += 1
        return func(*args, **(kwargs or {}))


class WorkCount:
    """Counts, on this thread, while the block runs: ``python`` (Python-level calls: every frame entered), ``c``
    (calls of C functions and builtins), ``torch_ops`` (torch functions and tensor methods), and by name:
    ``functions`` (``module:qualname`` of each Python call) and ``ops``."""

    def __init__(self) -> None:
        self.python = self.c = 0
        self.functions: Counter = Counter()
        self.ops: Counter = Counter()
        self._mode: _Ops | None = None

    def _profile(self, frame, event, arg) -> None:
        if event == "call":
            self.python += 1
            code = frame.f_code
            self.functions[f"{frame.f_globals.get('__name__', '?')}:{code.co_qualname}"] += 1
        elif event == "c_call":
            self.c += 1

    @property
    def torch_ops(self) -> int:
        """Torch functions and tensor methods that compute (allocate or launch work): every counted op except the
        reads of a tensor's metadata (``METADATA``: shape, dtype, dim, ..., answered from the host-side header)."""
        return sum(n for name, n in self.ops.items() if name not in METADATA)

    @property
    def metadata_reads(self) -> int:
        """Reads of a tensor's metadata (``METADATA``): no allocation, no device work."""
        return sum(n for name, n in self.ops.items() if name in METADATA)

    def __enter__(self) -> "WorkCount":
        self._mode = _Ops(self.ops)
        self._mode.__enter__()
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(None)
        self._mode.__exit__(*exc)

    def of(self, prefix: str) -> int:
        """Python calls into modules whose name starts with ``prefix`` (e.g. ``"moescope."``)."""
        return sum(n for name, n in self.functions.items() if name.startswith(prefix))


__all__ = ["WorkCount"]
