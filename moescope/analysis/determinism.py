"""The lifeline test before going live: route the same inputs N times and count the tokens whose expert set
changed between runs. A deterministic router flips nothing; noise, non-deterministic kernels or a
precision problem at near-ties show up here."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moescope.capture.observer import NOOP
from moescope.runtime import tokenizer
from moescope.runtime.model import MoETransformer, Segment


@dataclass
class DeterminismReport:
    runs: int
    tokens: int
    flip_rate: dict[int, float]  # layer -> share of (run > 0, token) pairs whose set differs from run 0
    flipped: list[dict] = field(default_factory=list)  # examples: run, layer, position, text, before, after

    @property
    def worst(self) -> float:
        return max(self.flip_rate.values(), default=0.0)


@torch.inference_mode()
def check(model: MoETransformer, prompts: list[str], runs: int = 5, max_examples: int = 20) -> DeterminismReport:
    ids = [tokenizer.encode(p) for p in prompts]
    flat = [t for seq in ids for t in seq]
    tokens = torch.tensor(flat, dtype=torch.long, device=model.device)
    observer, model.observer = model.observer, NOOP
    try:
        results = [{layer: d.ids.sort(-1).values.cpu() for layer, d in
                    model(tokens, [Segment(len(s)) for s in ids]).decisions.items()} for _ in range(runs)]
    finally:
        model.observer = observer
    base = results[0]
    flip_rate, flipped = {}, []
    for layer in base:
        diffs = [(r, (res[layer] != base[layer]).any(-1)) for r, res in enumerate(results[1:], 1)]
        total = sum(int(d.sum()) for _, d in diffs)
        flip_rate[layer] = total / (len(flat) * max(1, runs - 1))
        for r, d in diffs:
            for pos in d.nonzero().flatten().tolist():
                if len(flipped) < max_examples:
                    flipped.append({"run": r, "layer": layer, "position": pos,
                                    "text": tokenizer.token_text(flat[pos]),
                                    "before": base[layer][pos].tolist(), "after": results[r][layer][pos].tolist()})
    return DeterminismReport(runs=runs, tokens=len(flat), flip_rate=flip_rate, flipped=flipped)
