"""Fused Triton router kernel vs the torch router path, side by side (CUDA; one call, a few minutes).

For T = 1..16384 tokens, E = 8..256 experts, k = 2 and 8: median time of `route()` (torch: softmax, topk,
renormalise, entropy, margin) and of `route_kernel()` (one fused pass that also accumulates the per-expert
histogram and sums into device counters), timed with CUDA events over repeated calls; prints the table and
the ratio and writes benchmarks/results/router_kernel.json. The capture overhead on the decode step is
`python benchmarks/overhead.py --device cuda` (same machine, same run when the device is lent).

    python benchmarks/router_kernel.py [--quick]

Without a CUDA device, ``--quick`` runs the same table at small sizes with the kernel under Triton's CPU
interpreter (TRITON_INTERPRET=1) and wall-clock timing: a check that the script runs (CI), not a speed.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import torch

# Triton picks its interpreter when first imported: decide before the kernel module imports it.
INTERPRETED = "--quick" in sys.argv and not torch.cuda.is_available()
if INTERPRETED:
    os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _results  # noqa: E402

from moescope.kernels.router_triton import RouterCounters  # noqa: E402
from moescope.runtime.router import route, route_kernel  # noqa: E402


def _time(fn, reps: int = 50) -> float:
    for _ in range(5):
        fn()
    if INTERPRETED:  # no CUDA events: wall clock (the interpreter's time, not the kernel's)
        times = []
        for _ in range(3):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def main() -> None:
    ap = _results.parser(__doc__, quick="fewer sizes; without CUDA, small sizes under Triton's interpreter")
    args = _results.parse(ap, None, "router_kernel")
    if not torch.cuda.is_available() and not args.quick:
        sys.exit("router_kernel.py needs a CUDA device (without one, --quick runs it under Triton's interpreter)")
    device = "cpu" if INTERPRETED else "cuda"
    tokens = (1, 64) if INTERPRETED else (1, 256, 16384) if args.quick else (1, 16, 256, 2048, 16384)
    rows = []
    print(f"{'T':>6} {'E':>4} {'k':>2} {'torch us':>9} {'kernel us':>9} {'ratio':>6}")
    for T in _results.track(tokens, "router kernel: each token count"):
        for E in ((8, 64) if INTERPRETED else (8, 64, 256)):
            for k in (2, 8):
                if k > E:
                    continue
                logits = torch.randn(T, E, device=device)
                counters = RouterCounters.zeros(E, device)
                t_torch = _time(lambda: route(logits, k))
                t_kernel = _time(lambda: route_kernel(logits, k, counters=counters))
                rows.append({"tokens": T, "experts": E, "k": k, "torch_s": t_torch, "kernel_s": t_kernel,
                             "kernel_over_torch": t_kernel / t_torch})
                print(f"{T:>6} {E:>4} {k:>2} {t_torch * 1e6:>9.1f} {t_kernel * 1e6:>9.1f} "
                      f"{t_kernel / t_torch:>6.2f}")
    _results.save({"device": "cpu (Triton interpreter)" if INTERPRETED else torch.cuda.get_device_name(),
                   "torch": torch.__version__, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
