"""A seeded init whose routing is healthy: what ``--weights auto`` gives every model without weights of its own.

A random router over a random network is far from balanced (load CV ~1.3 per layer at deepseek-v3-shape):
the hidden states share a mean direction, so some experts' logits sit higher for every token, and router
rows of different norm spread differently. Fault scenarios on top of such a model would mean nothing.
Trained MoE models are balanced by an auxiliary loss or, in DeepSeek-V3, by the aux-loss-free correction
bias. Here, per MoE layer, on calibration traffic (held-out prompts of every domain, deterministic):

1. the router's rows lose their component along the layer's mean input and are scaled so that every
   expert's logit has the same spread (``logit_std``) over the calibration tokens: equal marginal chances;
2. DeepSeek-V3's balancing update, ``b += rate * sign(mean load - load)``, runs on the captured router
   inputs for a few rounds. Routers with a correction bias keep ``b`` there (so it ends up non-zero, as in a
   trained checkpoint); softmax routers, which have no bias, take it as a component along the mean input
   direction of their rows (``x . mean / |mean|^2`` is ~1 for every token, so it acts as a per-expert bias).

One forward over the calibration batch: each router is balanced on its own input just before it routes it,
so every layer sees the hidden states of the balanced layers above it (BALANCE_VERSION 2 took two forwards,
the second on the inputs the first one's changes produced; one is faster and no worse: at deepseek-v3-shape
on a loaded 2-core machine 47 s against 76 s, served-mix load CV mean 0.193 against 0.214 over 160 requests,
worst layer 0.32 both; qwen3-moe-shape 19 s against 31 s, 0.235 against 0.238, worst 0.57 both). The rounds
count load with ``RoutingRule.choose`` (a top-k over the kept groups only). The weights end on float16's grid:
deepseek-v3-shape's routers fit in 2 MB and ship in the package (``routers_cache``); a computed router
equals a loaded one.

What is left is structural: an untrained network's hidden states are dominated by the current byte, so
routing depends mostly on it and the served mix's byte frequencies show through (per-layer load CV ~0.3 on
the served mix at deepseek-v3-shape and qwen3-moe-shape, against a sampling floor of ~0.1 at 3k tokens:
docs/metrics.md, "Imbalance against the noise floor"). Deterministic for a seed.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

import torch

from moescope.capture.observer import NOOP
from moescope.progress import progress
from moescope.runtime import routers_cache, tokenizer, traffic
from moescope.runtime.model import MoETransformer, Segment
from moescope.runtime.model_config import preset
from moescope.runtime.router import Router
from moescope.runtime.routers_cache import BALANCE_VERSION

log = logging.getLogger("moescope.runtime")
CALIBRATION_SEED = 104729  # calibration prompts come from another stream than any served traffic's seed


def calibration_batch(seed: int, n_prompts: int, max_len: int | None = None) -> tuple[torch.Tensor, list[Segment]]:
    """Held-out prompts of the default domain mix as one flat batch (tokens [T], one segment per prompt), each cut
    to ``max_len`` tokens (the model's context: any valid config balances, however short its context)."""
    reqs = traffic.generate(traffic.TrafficConfig(seed=CALIBRATION_SEED + seed), n_prompts)
    ids = [tokenizer.encode(r.prompt)[:max_len] for r in reqs]
    return torch.tensor([t for seq in ids for t in seq], dtype=torch.long), [Segment(len(s)) for s in ids]


def router_inputs(model: MoETransformer, tokens: torch.Tensor, segments: list[Segment]) -> dict[int, torch.Tensor]:
    """Each MoE layer's router input [T, H] for the batch."""
    seen: dict[int, torch.Tensor] = {}
    handles = [m.router.register_forward_pre_hook(
        lambda mod, args, layer=m.layer_index: seen.__setitem__(layer, args[0].float()))
        for m in model.moe_layers()]
    observer, model.observer = model.observer, NOOP  # calibration is not served traffic
    try:
        model(tokens.to(model.device), segments, last_only=True)
    finally:
        model.observer = observer
        for h in handles:
            h.remove()
    return seen


def _balance_router(router: Router, x: torch.Tensor, top_k: int, logit_std: float, rounds: int,
                    rate: float) -> None:
    w = router.weight.double()  # [E, H]
    mean = x.double().mean(0)  # [H]
    w = w - torch.outer(w @ mean, mean) / mean.dot(mean)  # no expert favoured by the shared direction
    spread = (x.double() @ w.t()).std(0).clamp_min(1e-12)  # [E] each expert's logit spread
    w = (w * (logit_std / spread)[:, None]).float()
    logits = x @ w.t()  # [T, E]
    n_experts = w.shape[0]
    own_bias = router.e_score_correction_bias is not None
    bias = torch.zeros(n_experts)
    along = (x @ mean.float()) / mean.dot(mean).float()  # [T] ~1: a row component along mean acts as a bias
    # the bias works on scores (sigmoid: [0, 1]); the row component on logits (spread logit_std)
    step = rate if router.rule.scoring == "sigmoid" else rate * 8 * logit_std
    # selection only (no weights, entropy, margin): sigmoid is monotonic per expert, and softmax keeps the
    # logits' order, so the key is scores + bias, or the shifted logits themselves
    scores = router.rule.scores(logits, router.temperature)
    for r in range(rounds):
        key = scores + bias if own_bias else logits + along[:, None] * bias
        ids = router.rule.choose(key, top_k)
        load = torch.bincount(ids.reshape(-1), minlength=n_experts).float()
        bias += step * (1 - r / rounds) * torch.sign(load.mean() - load)  # shrinking steps settle
    if own_bias:
        router.e_score_correction_bias.copy_(bias)
    else:
        w = w + torch.outer(bias, mean.float()) / mean.dot(mean).float()
    # on float16's grid: the routers ship and cache in half the bytes (rounding moves a logit by ~1e-3 of
    # its spread) and a computed router equals a loaded one
    router.weight.copy_(w.half())


@torch.no_grad()
def balance_routing(model: MoETransformer, *, seed: int = 0, n_prompts: int = 96, logit_std: float = 1.0,
                    rounds: int = 15, rate: float = 0.04) -> None:
    """Balance ``model``'s routing on calibration traffic, in place (see the module docstring). The capacity
    limit is a serving setting, not the model's: calibration runs without it (so a ``drop`` fault serves the
    same weights as the healthy model, and reuses their cache)."""
    tokens, segments = calibration_batch(seed, n_prompts, model.cfg.max_seq_len)
    routers = [m for m in model.modules() if isinstance(m, Router)]
    limits = [r.capacity_factor for r in routers]
    # One intra-op thread: the same routers on every machine whatever its cores, and fast where cores are
    # shared (deepseek-v3-shape, 8 layers, on 2 cores at load ~7: 65 s with one thread, 165 s with two spinning
    # OpenMP threads; many small kernels gain nothing from a second thread)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    total = len(model.blocks) + len(model.moe_layers())  # each block's forward, each router's balancing

    def balance_on_input(router: Router, args) -> None:
        # each router is balanced on its input just before it routes it, so the layers below see the routing
        # (and hidden states) of the balanced layers above: one forward, not a forward per pass
        _balance_router(router, args[0].float(), model.cfg.top_k, logit_std, rounds, rate)
        advance()

    observer, model.observer = model.observer, NOOP  # calibration is not served traffic
    handles = []
    try:
        with progress(f"balancing {model.cfg.name}'s routers (once per shape)", total) as advance:
            for r in routers:
                r.capacity_factor = None
            handles = [m.router.register_forward_pre_hook(balance_on_input) for m in model.moe_layers()]
            handles += [b.register_forward_hook(lambda *_: advance()) for b in model.blocks]
            model(tokens.to(model.device), segments, last_only=True)
    finally:
        model.observer = observer
        for h in handles:
            h.remove()
        torch.set_num_threads(threads)
        for r, limit in zip(routers, limits):
            r.capacity_factor = limit


def _fingerprint(model: MoETransformer) -> list[float]:
    """Sums of the first parameters the seed produced (no router's): another torch's RNG gives other ones."""
    params = [p for name, p in model.named_parameters() if "router" not in name][:8]
    return [float(p.detach().double().sum()) for p in params]


def _router_state(model: MoETransformer) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if ".router." in k}


def _load(model: MoETransformer, path: Path, fingerprint: list[float]) -> bool:
    """Copy the routers in ``path`` into ``model`` if they were balanced for this very init."""
    from safetensors import safe_open  # start-up: safetensors, only when _load() runs

    state = _router_state(model)
    try:
        with safe_open(str(path), framework="pt") as f:
            theirs = json.loads((f.metadata() or {}).get("fingerprint", "[]"))
            # isclose: a sum's rounding may differ with the CPU's vector width; another RNG differs everywhere
            if (len(theirs) != len(fingerprint) or not all(map(math.isclose, theirs, fingerprint))
                    or set(f.keys()) != set(state)):
                return False
            cached = {k: f.get_tensor(k) for k in f.keys()}
    except Exception:  # unreadable: compute it
        return False
    with torch.no_grad():
        for k, v in cached.items():
            state[k].copy_(v)
    return True


def save_routers(model: MoETransformer, path: Path) -> None:
    """The model's routers (weights and correction biases) and its init's fingerprint, written atomically."""
    from safetensors.torch import save_file  # start-up: safetensors, only when save_routers() runs

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    # the weights on float16's grid (``_balance_router``): half the bytes, nothing lost; the biases float32
    tensors = {k: (v.half() if k.endswith(".weight") else v.float()).detach().contiguous()
               for k, v in _router_state(model).items()}
    save_file(tensors, str(tmp),
              metadata={"fingerprint": json.dumps(_fingerprint(model)), "balance_version": str(BALANCE_VERSION)})
    os.replace(tmp, path)  # atomic: concurrent builds never read half a file


def balanced_init(model: MoETransformer, *, seed: int = 0) -> None:
    """``balance_routing`` with its result (the routers only, a few MB) kept on disk: shipped in the package for
    the production-shape presets, else cached by the first build of a shape (~40 s at deepseek-v3-shape on 2
    loaded cores) and loaded by later ones. A cache that cannot be read or written is only a slower start."""
    fingerprint = _fingerprint(model)
    if any(_load(model, path, fingerprint) for path in routers_cache.found(model.cfg, seed)):
        return
    balance_routing(model, seed=seed)
    path = routers_cache.cache_dir() / routers_cache.file_name(model.cfg, seed)
    try:
        save_routers(model, path)
    except OSError as exc:
        log.info("cannot cache balanced routers in %s: %s", path.parent, exc)


SHIPPED_PRESETS = ("deepseek-v3-shape",)  # the presets whose routers ship in the package (< 2 MB each)


def ship(name: str) -> Path:
    """Balance preset ``name``'s routers and write them into the package (``python -m moescope.runtime.balance
    NAME``; after a ``BALANCE_VERSION`` bump, the stale file is removed by hand and this writes the new one)."""
    cfg = preset(name)
    model = MoETransformer(cfg).eval()
    balance_routing(model, seed=cfg.seed)
    path = routers_cache.SHIPPED / routers_cache.file_name(cfg, cfg.seed)
    save_routers(model, path)
    return path


if __name__ == "__main__":
    import sys

    for name in sys.argv[1:] or SHIPPED_PRESETS:
        print(ship(name))
