"""Our MoE layer equals HuggingFace transformers' Mixtral sparse MoE block with the same weights (the
benchmark's pairing, at a small shape)."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import runtime as bench  # noqa: E402


def test_moe_layer_equals_hf_mixtral_block():
    hf, ours = bench.build_pair(hidden=64, ffn=96, n_experts=8, top_k=2, seed=3)
    with torch.no_grad():
        for n in (1, 7, 64):
            x = torch.randn(n, 64, generator=torch.Generator().manual_seed(n))
            ref = bench.hf_forward(hf, x)
            got, decision, logits, *_ = ours(x)
            torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(logits, hf.gate(x)[0] if isinstance(hf.gate(x), tuple) else hf.gate(x))


def test_benchmark_report_shape(tmp_path):
    report = bench.run([1, 4], rounds=2, hidden=64, ffn=96)
    assert [r["tokens"] for r in report["results"]] == [1, 4]
    for r in report["results"]:
        assert r["max_abs_diff"] < 1e-5 and r["ours_s"] > 0 and r["hf_s"] > 0
    assert report["ours_1_token_over_floor"] > 0
