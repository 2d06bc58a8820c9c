"""Train the tiny demo model offline, on text every machine has (see corpus.py), in a few minutes on 2 cores.

Loss = next-byte cross-entropy + ``aux_coef`` x the Switch-Transformer load-balancing loss
(E * sum_e f_e * P_e per MoE layer, f_e = share of slots routed to e, P_e = mean router probability of e)
+ ``z_coef`` x the router z-loss. The balancing loss keeps experts alive; the domains are different enough
(code, prose, numbers, multi-byte unicode) that experts still specialise, which ``expert_load_by_domain``
measures on held-out text.

Run: ``moescope train-demo`` (writes moescope/assets/tiny-demo.safetensors and tiny-demo.json).
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from moescope import stats
from moescope.runtime import corpus, tokenizer, weights
from moescope.runtime.model_config import MoEConfig, preset
from moescope.runtime.model import MoETransformer
from moescope.runtime.traffic import TrafficConfig


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 800
    batch: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    warmup: int = 50
    aux_coef: float = 0.015
    z_coef: float = 1e-3
    seed: int = 0


def _batches(cfg: TrainConfig, part: str, rng: random.Random):
    data = {d: torch.tensor(list(corpus.split(corpus.domain_text(d), part).encode("utf-8")), dtype=torch.long)
            for d in corpus.DOMAINS}
    n = cfg.seq_len  # BOS + (n - 1) bytes in, n bytes out
    mix = TrafficConfig().domains
    names = sorted(mix)
    while True:
        rows = []
        # The serving traffic's domain mix: the balancing loss then balances the load operators will see.
        for d in rng.choices(names, weights=[mix[n] for n in names], k=cfg.batch):
            start = rng.randrange(len(data[d]) - n)
            rows.append(torch.cat([torch.tensor([tokenizer.BOS]), data[d][start:start + n]]))
        yield torch.stack(rows)  # [B, n + 1]


def balance_loss(router_logits: torch.Tensor, ids: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Switch load-balancing loss for one layer: E * sum_e f_e * P_e (1.0 when perfectly balanced)."""
    probs = torch.softmax(router_logits, dim=-1)  # [T, E]
    frac = torch.bincount(ids.reshape(-1), minlength=n_experts).float() / ids.numel()  # [E], no grad
    return n_experts * (frac * probs.mean(0)).sum()


def train(model_cfg: MoEConfig, cfg: TrainConfig, *, log=print) -> tuple[MoETransformer, dict]:
    torch.manual_seed(cfg.seed)
    model = MoETransformer(model_cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.01)
    batches = _batches(cfg, "train", random.Random(cfg.seed))
    t0, history = time.perf_counter(), []
    for step in range(cfg.steps):
        lr = cfg.lr * min(1.0, (step + 1) / cfg.warmup) * 0.5 * (1 + math.cos(math.pi * step / cfg.steps))
        for g in opt.param_groups:
            g["lr"] = lr
        batch = next(batches)
        out = model.forward_batch(batch[:, :-1])
        ce = F.cross_entropy(out.logits, batch[:, 1:].reshape(-1))
        aux = sum(balance_loss(out.router_logits[i], d.ids, model_cfg.n_experts) for i, d in out.decisions.items())
        z = sum(torch.logsumexp(lg, -1).pow(2).mean() for lg in out.router_logits.values())
        loss = ce + cfg.aux_coef * aux + cfg.z_coef * z
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == cfg.steps - 1:
            history.append({"step": step, "ce": round(ce.item(), 4), "aux": round(aux.item(), 4)})
            log(f"step {step:5d}  ce {ce.item():.3f}  bits/byte {ce.item() / math.log(2):.3f}  "
                f"aux {aux.item():.3f}  {time.perf_counter() - t0:.0f}s")
    model.eval()
    return model, {"train_seconds": round(time.perf_counter() - t0, 1), "history": history}


@torch.no_grad()
def expert_load_by_domain(model: MoETransformer, *, tokens_per_domain: int = 8192, seq_len: int = 128
                          ) -> dict[str, dict[int, list[float]]]:
    """Share of slots per expert, per domain and MoE layer, on held-out text: {domain: {layer: [E]}}."""
    result: dict[str, dict[int, list[float]]] = {}
    for d in corpus.DOMAINS:
        data = list(corpus.split(corpus.domain_text(d), "heldout").encode("utf-8"))
        n_rows = max(1, min(tokens_per_domain // seq_len, len(data) // seq_len))
        rows = torch.tensor([[tokenizer.BOS] + data[i * seq_len:(i + 1) * seq_len - 1] for i in range(n_rows)])
        out = model.forward_batch(rows)
        result[d] = {}
        for layer, dec in out.decisions.items():
            counts = torch.bincount(dec.ids.reshape(-1), minlength=model.cfg.n_experts).double()
            result[d][layer] = [round(x, 4) for x in (counts / counts.sum()).tolist()]
    return result


def specialisation_report(load: dict[str, dict[int, list[float]]]) -> dict:
    """Mean pairwise JS divergence between domains per layer, and each domain's top-2 experts per layer."""
    domains = list(load)
    layers = list(next(iter(load.values())))
    report = {"mean_pairwise_jsd_bits": {}, "top_experts": {d: {} for d in domains}}
    for layer in layers:
        pairs = [stats.jensen_shannon(load[a][layer], load[b][layer])
                 for i, a in enumerate(domains) for b in domains[i + 1:]]
        report["mean_pairwise_jsd_bits"][layer] = round(sum(pairs) / len(pairs), 4)
        for d in domains:
            shares = load[d][layer]
            report["top_experts"][d][layer] = sorted(range(len(shares)), key=lambda e: -shares[e])[:2]
    return report


def main(out: Path = weights.DEMO_WEIGHTS, cfg: TrainConfig = TrainConfig(), *, log=print) -> dict:
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model, info = train(preset("tiny-demo"), cfg, log=log)
    load = expert_load_by_domain(model)
    card = {"config": model.cfg.to_dict(), "train": {**cfg.__dict__, **info},
            "expert_load_by_domain": load, "specialisation": specialisation_report(load)}
    weights.save(model, out, extra={"moescope_train": json.dumps(cfg.__dict__)})
    out.with_suffix(".json").write_text(json.dumps(card, indent=1) + "\n")
    log(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB) and {out.with_suffix('.json')}")
    return card
