"""What capture costs on the decode step, eager and as a CUDA graph, on a Mixtral-shaped and a DeepSeek-V3-shaped
MoE block (attention + one MoE layer; bf16 on CUDA), side by side in interleaved rounds in one run.

Variants, each timed over ``--steps`` decode steps (one new token per sequence, ``--batch`` sequences with a
128-token history), medians over ``--rounds``:
- eager bare: the runtime's own decode forward (per-sequence KV caches), nobody observing;
- eager instrumented: the same under ``moescope.instrument`` (metrics, routing probe, layer timer on CUDA events);
- graph bare: ``StaticDecoder(count=False)`` captured as a CUDA graph and replayed;
- graph instrumented: the same with the in-graph counters, and ``GraphCollector.collect()`` after every step
  (the worst case: a collector normally reads once per scrape or interval).
Prints the table and the ratios instrumented / bare; writes benchmarks/results/decode_step.json (CUDA) or
decode_step-cpu.json. On CPU there is no graph: the "graph" rows run the same fixed-shape step uncaptured,
and ``--quick`` scales the shapes down 16x (a smoke run of the script itself).

    python benchmarks/decode_step.py [--quick] [--device cuda] [--batch 1 32] [--rounds 5] [--steps 30]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _results  # noqa: E402

import moescope  # noqa: E402
from moescope.capture.observer import NOOP  # noqa: E402
from moescope.runtime.model_config import MoEConfig  # noqa: E402
from moescope.runtime.graph_decode import GraphCollector, StaticDecoder  # noqa: E402
from moescope.runtime.model import MoETransformer, Segment  # noqa: E402

HISTORY = 128
SHAPES = {  # name: (hidden, heads, experts, k, ffn)
    "mixtral-layer": (4096, 32, 8, 2, 14336),
    "deepseek-v3-layer": (7168, 56, 256, 8, 2048),  # MHA stands in for MLA; the MoE layer is V3's routed part
}


class _Uninitialised(MoETransformer):
    def reset_parameters(self, seed: int) -> None:  # filled on the device below (V3's experts are 22 GB in bf16)
        pass


def build(name: str, device: str, dtype: torch.dtype, scale: int) -> MoETransformer:
    hidden, heads, experts, k, ffn = SHAPES[name]
    cfg = MoEConfig(name=name, hidden_size=hidden // scale, n_layers=1,
                    n_heads=heads if scale == 1 else hidden // scale // 64, n_experts=experts, top_k=k,
                    ffn_size=ffn // scale, max_seq_len=HISTORY + 8)
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = _Uninitialised(cfg)
    finally:
        torch.set_default_dtype(before)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model.eval()


def _median_step(fn, steps: int, sync) -> float:
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    sync()
    return (time.perf_counter() - t0) / steps


def measure(model: MoETransformer, batch: int, rounds: int, steps: int) -> dict:
    dev = model.device
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    gen = torch.Generator(device=dev).manual_seed(1)
    caches = [model.new_cache() for _ in range(batch)]
    with torch.no_grad():
        model(torch.randint(0, 256, (batch * HISTORY,), device=dev, generator=gen),
              [Segment(HISTORY, c) for c in caches])
    tokens = torch.randint(0, 256, (batch,), device=dev, generator=gen)
    positions = torch.full((batch,), HISTORY, dtype=torch.int64, device=dev)

    def eager():
        for c in caches:
            c.length = HISTORY  # every step decodes at the same position: equal work each time
        with torch.no_grad():
            model(tokens, [Segment(1, c) for c in caches])

    decoders = {}
    for count in (False, True):
        d = StaticDecoder(model, batch, count=count)
        for slot, c in enumerate(caches):
            d.load(slot, c)
        if cuda:
            d.capture()
        decoders[count] = d
    inst = moescope.instrument(model)
    model.observer = NOOP
    collector = GraphCollector(decoders[True].counters, inst.metrics.on_stats)

    def graph_instrumented():
        decoders[True].step(tokens, positions)
        collector.collect()

    variants = {
        "eager_bare": (eager, NOOP),
        "eager_instrumented": (eager, inst.observer),
        "graph_bare": (lambda: decoders[False].step(tokens, positions), NOOP),
        "graph_instrumented": (graph_instrumented, NOOP),
    }
    times = {k: [] for k in variants}
    for fn, obs in variants.values():  # warm-up (Triton compile, allocator, the probe's first flush)
        model.observer = obs
        _median_step(fn, 2, sync)
    for _ in range(rounds):
        for name, (fn, obs) in variants.items():
            model.observer = obs
            times[name].append(_median_step(fn, steps, sync))
    model.observer = NOOP
    inst.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"batch": batch, "experts_mode": decoders[True].experts_mode,
            **{f"{k}_s": v for k, v in med.items()},
            "eager_ratio": med["eager_instrumented"] / med["eager_bare"],
            "graph_ratio": med["graph_instrumented"] / med["graph_bare"],
            "graph_speedup": med["eager_bare"] / med["graph_bare"]}


def main(argv: list[str] | None = None) -> None:
    ap = _results.parser(__doc__, quick="fewer rounds; on CPU, one round, shapes scaled down 16x", rounds=7)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, nargs="+", default=None, help="[1 32; --quick on CPU: 1 4]")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    # --quick on CPU is a smoke run of the script (CI): one round of 3 steps; on CUDA a short measurement
    args = _results.parse(ap, argv, lambda a: "decode_step" if a.device.startswith("cuda") else "decode_step-cpu",
                          quick_rounds=lambda a: 3 if a.device.startswith("cuda") else 1)
    cuda = args.device.startswith("cuda")
    rounds = args.rounds
    steps = args.steps or ((5 if cuda else 3) if args.quick else 30)
    batches = args.batch or ([1, 4] if args.quick and not cuda else [1, 32])
    scale = 16 if args.quick and not cuda else 1
    dtype = torch.bfloat16 if cuda else torch.float32
    rows = []
    print(f"decode step, {args.device}, {dtype}, torch {torch.__version__}, shapes / {scale}, "
          f"{'CUDA graph' if cuda else 'no graph on CPU: fixed-shape step uncaptured'}")
    print(f"{'shape':<18} {'B':>3} {'eager us':>9} {'+capture':>9} {'ratio':>6} {'graph us':>9} {'+counters':>9} "
          f"{'ratio':>6} {'graph/eager':>11}")
    model, built = None, None
    for name, batch in _results.track([(name, batch) for name in args.shapes for batch in batches],
                                      "decode step: each shape and batch, the variants interleaved"):
        if built != name:
            model = None  # the last shape's memory back before the next one is built
            if cuda:
                torch.cuda.empty_cache()
            model, built = build(name, args.device, dtype, scale), name
        r = {"shape": name, **measure(model, batch, rounds, steps)}
        rows.append(r)
        print(f"{name:<18} {batch:>3} {r['eager_bare_s'] * 1e6:>9.0f} {r['eager_instrumented_s'] * 1e6:>9.0f} "
              f"{r['eager_ratio']:>6.3f} {r['graph_bare_s'] * 1e6:>9.0f} {r['graph_instrumented_s'] * 1e6:>9.0f} "
              f"{r['graph_ratio']:>6.3f} {1 / r['graph_speedup']:>11.2f}")
    _results.save({"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                   "dtype": str(dtype), "scale": scale, "rounds": rounds, "steps": steps, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
