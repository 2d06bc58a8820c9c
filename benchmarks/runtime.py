"""MoE layer throughput: moescope's grouped MoE layer vs HuggingFace transformers' Mixtral sparse MoE block.

Same weights (copied from the HF block), fp32, Mixtral-shaped at a quarter width (hidden 1024, ffn 2816,
8 experts, top-2). For each token count the two are timed in interleaved rounds in one process (the machine
is shared and noisy: medians and ratios are what count), outputs compared numerically, and the single-token
time is set against the memory-bandwidth floor: the bytes of the two chosen experts' weights divided by the
copy bandwidth measured in the same run.

    python benchmarks/runtime.py [--tokens 1 16 256 2048] [--rounds 15] [--out benchmarks/results/runtime.json]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

from _results import save

import torch

HERE = Path(__file__).resolve().parent


def build_pair(hidden: int, ffn: int, n_experts: int, top_k: int, seed: int = 0):
    """(hf_block, our_layer) with identical weights; works on transformers 4.5x (ModuleList experts with
    w1/w2/w3) and 5.x (fused gate_up_proj/down_proj)."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    from moescope.runtime.config import MoEConfig
    from moescope.runtime.model import MoELayer

    hf_cfg = MixtralConfig(hidden_size=hidden, intermediate_size=ffn, num_local_experts=n_experts,
                           num_experts_per_tok=top_k, router_jitter_noise=0.0)
    torch.manual_seed(seed)
    hf = MixtralSparseMoeBlock(hf_cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.02)
    ours = MoELayer(MoEConfig(hidden_size=hidden, n_heads=8, n_experts=n_experts, top_k=top_k,
                              ffn_size=ffn)).eval()
    with torch.no_grad():
        ours.router.weight.copy_(hf.gate.weight)
        if hasattr(hf.experts, "gate_up_proj"):  # transformers 5.x
            ours.experts.gate_up_proj.copy_(hf.experts.gate_up_proj)
            ours.experts.down_proj.copy_(hf.experts.down_proj)
        else:  # 4.x: w1 = gate, w3 = up, w2 = down
            for e, mlp in enumerate(hf.experts):
                ours.experts.gate_up_proj[e].copy_(torch.cat([mlp.w1.weight, mlp.w3.weight]))
                ours.experts.down_proj[e].copy_(mlp.w2.weight)
    return hf, ours


def hf_forward(hf, x):
    out = hf(x[None])
    return (out[0] if isinstance(out, tuple) else out)[0]  # 4.x returns (hidden, router_logits)


def copy_bandwidth(n_bytes: int = 256 * 2**20, repeats: int = 7) -> float:
    """Bytes/s of a large tensor copy (bytes counted once), median of ``repeats``."""
    src = torch.ones(n_bytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return n_bytes / statistics.median(times)


def _time(fn, x) -> float:
    t = time.perf_counter()
    fn(x)
    return time.perf_counter() - t


def run(tokens: list[int], rounds: int, hidden=1024, ffn=2816, n_experts=8, top_k=2) -> dict:
    hf, ours = build_pair(hidden, ffn, n_experts, top_k)
    results = []
    with torch.inference_mode():
        bw = copy_bandwidth()
        for n in tokens:
            x = torch.randn(n, hidden, generator=torch.Generator().manual_seed(n))
            ref, got = hf_forward(hf, x), ours(x)[0]
            max_diff = (ref - got).abs().max().item()
            reps = max(1, min(20, 2048 // max(n, 1)))  # several calls per sample at small n
            ours_fn = lambda x: [ours(x) for _ in range(reps)]  # noqa: E731
            hf_fn = lambda x: [hf_forward(hf, x) for _ in range(reps)]  # noqa: E731
            ours_fn(x), hf_fn(x)  # warm-up
            t_ours, t_hf = [], []
            for r in range(rounds):  # interleaved, alternating who goes first
                pair = [(t_ours, ours_fn), (t_hf, hf_fn)]
                for acc, fn in (pair if r % 2 == 0 else pair[::-1]):
                    acc.append(_time(fn, x) / reps)
            mo, mh = statistics.median(t_ours), statistics.median(t_hf)
            results.append({"tokens": n, "ours_s": mo, "hf_s": mh, "ours_tokens_per_s": n / mo,
                            "hf_tokens_per_s": n / mh, "speedup_vs_hf": mh / mo, "max_abs_diff": max_diff})
    expert_bytes = 3 * hidden * ffn * 4
    floor_s = top_k * expert_bytes / bw
    one = next((r for r in results if r["tokens"] == 1), None)
    return {
        "shape": {"hidden": hidden, "ffn": ffn, "experts": n_experts, "top_k": top_k, "dtype": "float32"},
        "machine": {"cpu_threads": torch.get_num_threads(), "torch": torch.__version__,
                    "python": platform.python_version()},
        "transformers": __import__("transformers").__version__,
        "rounds": rounds,
        "copy_bandwidth_gb_s": bw / 1e9,
        "expert_bytes": expert_bytes,
        "bandwidth_floor_1_token_s": floor_s,
        "ours_1_token_over_floor": one["ours_s"] / floor_s if one else None,
        "results": results,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256, 2048])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "runtime.json")
    args = ap.parse_args(argv)
    report = run(args.tokens, args.rounds)
    print(f"MoE block hidden 1024, ffn 2816, 8 experts, top-2, fp32; torch {report['machine']['torch']}, "
          f"transformers {report['transformers']}, {report['machine']['cpu_threads']} threads, "
          f"medians of {args.rounds} interleaved rounds")
    print(f"{'tokens':>7} {'ours tok/s':>11} {'HF tok/s':>10} {'ours/HF':>8} {'max|diff|':>10}")
    for r in report["results"]:
        print(f"{r['tokens']:>7} {r['ours_tokens_per_s']:>11.1f} {r['hf_tokens_per_s']:>10.1f} "
              f"{r['speedup_vs_hf']:>7.2f}x {r['max_abs_diff']:>10.2e}")
    if report["ours_1_token_over_floor"] is not None:
        print(f"copy bandwidth {report['copy_bandwidth_gb_s']:.1f} GB/s; 1-token floor "
              f"{report['bandwidth_floor_1_token_s'] * 1e3:.2f} ms (2 experts x {report['expert_bytes'] / 1e6:.1f} MB);"
              f" ours at 1 token = {report['ours_1_token_over_floor']:.2f}x the floor")
    save(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
