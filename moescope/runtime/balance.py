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

Two passes over the model (the second sees the inputs the first pass's changes upstream produced).
What is left is structural: an untrained network's hidden states are dominated by the current byte, so
routing depends mostly on it and the served mix's byte frequencies show through (per-layer load CV ~0.3 on
the served mix at deepseek-v3-shape and qwen3-moe-shape, against a sampling floor of ~0.1 at 3k tokens:
docs/metrics.md, "Imbalance against the noise floor"). Deterministic for a seed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch

from moescope.capture.observer import NOOP
from moescope.progress import progress
from moescope.runtime import tokenizer, traffic
from moescope.runtime.model import MoETransformer, Segment
from moescope.runtime.router import Router

log = logging.getLogger("moescope.runtime")
CALIBRATION_SEED = 104729  # calibration prompts come from another stream than any served traffic's seed


def calibration_batch(seed: int, n_prompts: int) -> tuple[torch.Tensor, list[Segment]]:
    """Held-out prompts of the default domain mix as one flat batch (tokens [T], one segment per prompt)."""
    reqs = traffic.generate(traffic.TrafficConfig(seed=CALIBRATION_SEED + seed), n_prompts)
    ids = [tokenizer.encode(r.prompt) for r in reqs]
    return torch.tensor([t for seq in ids for t in seq], dtype=torch.long), [Segment(len(s)) for s in ids]


def router_inputs(model: MoETransformer, tokens: torch.Tensor, segments: list[Segment],
                  advance=None) -> dict[int, torch.Tensor]:
    """Each MoE layer's router input [T, H] for the batch (``advance()`` after each block, for a progress bar)."""
    seen: dict[int, torch.Tensor] = {}
    handles = [m.router.register_forward_pre_hook(
        lambda mod, args, layer=m.layer_index: seen.__setitem__(layer, args[0].float()))
        for m in model.moe_layers()]
    if advance is not None:
        handles += [b.register_forward_hook(lambda *_: advance()) for b in model.blocks]
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
    router.weight.copy_(w.to(router.weight.dtype))


@torch.no_grad()
def balance_routing(model: MoETransformer, *, seed: int = 0, n_prompts: int = 96, logit_std: float = 1.0,
                    passes: int = 2, rounds: int = 15, rate: float = 0.04) -> None:
    """Balance ``model``'s routing on calibration traffic, in place (see the module docstring). The capacity
    limit is a serving setting, not the model's: calibration runs without it (so a ``drop`` fault serves the
    same weights as the healthy model, and reuses their cache)."""
    tokens, segments = calibration_batch(seed, n_prompts)
    routers = [m for m in model.modules() if isinstance(m, Router)]
    limits = [r.capacity_factor for r in routers]
    # One intra-op thread: the same routers on every machine whatever its cores, and fast where cores are
    # shared (deepseek-v3-shape, 8 layers, on 2 cores at load ~7: 65 s with one thread, 165 s with two spinning
    # OpenMP threads; many small kernels gain nothing from a second thread)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    # a forward over the calibration batch, then each MoE layer's router, per pass
    total = passes * (len(model.blocks) + len(model.moe_layers()))
    try:
        with progress(f"balancing {model.cfg.name}'s routers (once per shape)", total) as advance:
            for r in routers:
                r.capacity_factor = None
            for p in range(passes):
                for layer, x in router_inputs(model, tokens, segments, advance).items():
                    _balance_router(model.blocks[layer].ffn.router, x, model.cfg.top_k, logit_std,
                                    rounds if p == passes - 1 else 0, rate)
                    advance()
    finally:
        torch.set_num_threads(threads)
        for r, limit in zip(routers, limits):
            r.capacity_factor = limit


BALANCE_VERSION = 2  # bump when the procedure changes: cached results of an older one are not reused


def cache_dir() -> Path:
    """Where balanced routers are cached: ``$MOESCOPE_CACHE``, else ``$XDG_CACHE_HOME/moescope``, else
    ``~/.cache/moescope``."""
    root = os.environ.get("MOESCOPE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "moescope")
    return Path(root) / "balanced-routers"


def _cache_key(model: MoETransformer, seed: int) -> str:
    # The routers are balanced for this exact init: the key holds the config and a fingerprint of the
    # parameters the seed produced (a different torch RNG would give other hidden states).
    fingerprint = [float(p.detach().double().sum()) for name, p in model.named_parameters() if "router" not in name][:8]
    # the capacity factor is serving, not the model; the name is a label (a renamed preset has the same weights)
    cfg = {k: v for k, v in model.cfg.to_dict().items() if k not in ("capacity_factor", "name")}
    text = json.dumps([BALANCE_VERSION, cfg, seed, fingerprint], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _router_state(model: MoETransformer) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if ".router." in k}


def balanced_init(model: MoETransformer, *, seed: int = 0) -> None:
    """``balance_routing`` with its result (the routers only, a few MB) cached on disk: the first build of a
    shape takes ~30 s on 2 cores at deepseek-v3-shape, later ones load the routers. A cache that cannot be
    read or written is only a slower start."""
    from safetensors.torch import load_file, save_file

    path = cache_dir() / f"routers-{_cache_key(model, seed)}.safetensors"
    try:
        cached = load_file(str(path))
    except Exception:  # absent or unreadable: compute it
        cached = None
    state = _router_state(model)
    if cached is not None and set(cached) == set(state):
        with torch.no_grad():
            for k, v in cached.items():
                state[k].copy_(v)
        return
    balance_routing(model, seed=seed)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        save_file({k: v.detach().float().contiguous() for k, v in _router_state(model).items()}, str(tmp))
        os.replace(tmp, path)  # atomic: concurrent builds never read half a file
    except OSError as exc:
        log.info("cannot cache balanced routers in %s: %s", path.parent, exc)
