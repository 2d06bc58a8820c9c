"""capture.token_trace.pack (many steps packed in one go) against a naive per-step, per-layer reference."""

from __future__ import annotations

import numpy as np
import torch

from moescope.capture.token_trace import StepTrace, pack
from moescope.runtime.engine import StepRecord
from moescope.runtime.router import route


def _step(index: int, n_tokens: int, layers, n_experts: int, k: int, gen, capacity=None) -> StepTrace:
    decisions = tuple((layer, route(torch.randn(n_tokens, n_experts, generator=gen), k, capacity_factor=capacity))
                      for layer in layers)
    rec = StepRecord(index, "decode", 0.0, 0.001, n_tokens, tuple((f"r{i}", 0, 1) for i in range(n_tokens)))
    return StepTrace(rec, decisions, {}, {}, {}, {}, 0.0)


def _naive(trace: StepTrace) -> dict[str, np.ndarray]:
    """Token by token, layer by layer, with Python loops: what the store must hold for the step."""
    n_tok = trace.decisions[0][1].ids.shape[0]
    out = {"ids": [], "weights": [], "entropy": [], "margin": []}
    for t in range(n_tok):
        for key in out:
            out[key].append([])
        for _, d in trace.decisions:
            out["ids"][-1].append([int(x) for x in d.active_ids[t]])
            out["weights"][-1].append([float(x) for x in d.weights[t]])
            out["entropy"][-1].append(float(d.entropy[t]))
            out["margin"][-1].append(float(d.margin[t]))
    return {key: np.array(v) for key, v in out.items()}


def test_pack_equals_a_naive_reference_over_ragged_steps_and_mixed_shapes():
    gen = torch.Generator().manual_seed(0)
    traces = [
        _step(0, 5, (1, 2, 3), 8, 2, gen, capacity=0.6),  # drops: active ids hold the sentinel E
        _step(1, 1, (1, 2, 3), 8, 2, gen),  # a decode step of one token
        _step(2, 7, (3, 4), 256, 8, gen),  # another shape in the same batch: its own group
        _step(3, 3, (1, 2, 3), 8, 2, gen),
    ]
    bad = _step(4, 2, (1, 2), 8, 2, gen)
    ragged = StepTrace(bad.step, (bad.decisions[0], (2, route(torch.randn(3, 8, generator=gen), 2))), {}, {}, {},
                       {}, 0.0)  # layers disagree on the token count: not packable
    packed = pack([*traces, ragged])
    assert packed[-1] is None
    for trace, arrays in zip(traces, packed[:-1]):
        ref = _naive(trace)
        rows = arrays.records()
        assert arrays.layers == tuple(layer for layer, _ in trace.decisions)
        assert rows.shape == ref["entropy"].shape
        np.testing.assert_array_equal(rows["ids"], ref["ids"])
        for key in ("weights", "entropy", "margin"):
            np.testing.assert_array_equal(rows[key], ref[key].astype(np.float16))
        assert not rows["miss"].any()
    assert (packed[0].records()["ids"] == 8).any()  # the capacity limit dropped some slots


def test_a_request_sliced_out_of_packed_steps_is_its_tokens_in_order():
    """The writer concatenates byte slices of several steps: the result reads as the tokens' records."""
    gen = torch.Generator().manual_seed(1)
    traces = [_step(i, n, (1, 2, 3), 8, 2, gen) for i, n in enumerate((4, 2, 3))]
    packed = pack(traces)
    parts = [(packed[0], 1, 2), (packed[1], 0, 1), (packed[2], 2, 1)]  # (step, offset, tokens)
    rows = packed[0].records(np.concatenate([a.raw[o:o + n] for a, o, n in parts]))
    ref = np.concatenate([_naive(tr)["ids"][o:o + n] for tr, (_, o, n) in zip(traces, parts)])
    np.testing.assert_array_equal(rows["ids"], ref)
