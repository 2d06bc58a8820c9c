"""Synthetic serving traffic: requests with a domain, a tenant, a prompt, an output length and an arrival time.

Arrivals are a Poisson process (``rate`` requests/s; 0 = all at time 0). Prompt lengths are log-normal in
bytes, output lengths log-normal in tokens, both clipped. Prompts are windows of held-out domain text.
The domain mix can change at a point in the stream (``shift_after`` / ``shifted_domains``): the traffic
side of the drift scenario. Everything is deterministic for a seed.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass, field

from moescope.errors import ConfigError
from moescope.runtime import corpus


@dataclass(frozen=True)
class TrafficConfig:
    domains: dict[str, float] = field(default_factory=lambda: {"code": 0.35, "prose": 0.35, "numbers": 0.2,
                                                               "unicode": 0.1})
    tenants: dict[str, float] = field(default_factory=lambda: {"tenant-a": 0.5, "tenant-b": 0.3,
                                                               "tenant-c": 0.2})
    rate: float = 0.0  # requests per second; 0 = every request arrives at t=0
    prompt_bytes_median: int = 64
    prompt_bytes_range: tuple[int, int] = (8, 256)
    output_tokens_median: int = 24
    output_tokens_range: tuple[int, int] = (4, 96)
    sigma: float = 0.5  # log-normal spread of both lengths
    shift_after: int | None = None  # request index where the domain mix switches
    shifted_domains: dict[str, float] | None = None
    # narrow traffic: only this many distinct requests (prompt, domain, tenant, length), each arrival one of them
    # at random (None: every request its own). The templates are the same for every seed (a product's fixed
    # prompts: broad traffic's first requests at seed 0); the seed picks arrivals and their order.
    distinct_prompts: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("domains", "tenants"):
            mix = getattr(self, name)
            if not mix or any(w < 0 for w in mix.values()) or sum(mix.values()) <= 0:
                raise ConfigError(f"traffic {name} must be a non-empty mapping of non-negative weights")
        unknown = set(self.domains) | set(self.shifted_domains or {})
        unknown -= set(corpus.DOMAINS)
        if unknown:
            raise ConfigError(f"unknown traffic domain(s) {sorted(unknown)}; known: {', '.join(corpus.DOMAINS)}")
        if self.rate < 0:
            raise ConfigError(f"traffic rate must be >= 0, got {self.rate}")
        if self.distinct_prompts is not None and self.distinct_prompts < 1:
            raise ConfigError(f"traffic distinct_prompts must be >= 1, got {self.distinct_prompts}")
        for name in ("prompt_bytes_range", "output_tokens_range"):
            lo, hi = getattr(self, name)
            if not 0 < lo <= hi:
                raise ConfigError(f"{name} must satisfy 0 < low <= high, got {(lo, hi)}")


@dataclass(frozen=True)
class TrafficRequest:
    index: int
    arrival_s: float
    prompt: str
    max_new_tokens: int
    domain: str
    tenant: str


def _pick(rng: random.Random, mix: dict[str, float]) -> str:
    names = sorted(mix)
    return rng.choices(names, weights=[mix[n] for n in names])[0]


def _lognormal_int(rng: random.Random, median: int, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(math.exp(rng.gauss(math.log(median), sigma))))))


def _prompt(rng: random.Random, text: str, n_bytes: int) -> str:
    """A window of ``text`` starting at a line start, cut to at most ``n_bytes`` UTF-8 bytes."""
    start = rng.randrange(max(1, len(text) - 4 * n_bytes))
    nl = text.find("\n", start)
    start = nl + 1 if 0 <= nl < len(text) - 1 else start
    window = text[start:start + n_bytes]
    while len(window.encode("utf-8")) > n_bytes:  # multi-byte characters: trim to the byte budget
        window = window[:-1]
    return window or text[:n_bytes]


def generate(cfg: TrafficConfig, n: int) -> list[TrafficRequest]:
    """``n`` requests in arrival order."""
    rng = random.Random(cfg.seed)
    held_out = {d: corpus.split(corpus.domain_text(d), "heldout") for d in corpus.DOMAINS}
    out, t = [], 0.0
    for i in range(n):
        mix = cfg.shifted_domains if cfg.shift_after is not None and i >= cfg.shift_after and \
            cfg.shifted_domains else cfg.domains
        domain = _pick(rng, mix)
        n_bytes = _lognormal_int(rng, cfg.prompt_bytes_median, cfg.sigma, *cfg.prompt_bytes_range)
        n_out = _lognormal_int(rng, cfg.output_tokens_median, cfg.sigma, *cfg.output_tokens_range)
        if cfg.rate > 0 and i:
            t += rng.expovariate(cfg.rate)
        out.append(TrafficRequest(index=i, arrival_s=t, prompt=_prompt(rng, held_out[domain], n_bytes),
                                  max_new_tokens=n_out, domain=domain, tenant=_pick(rng, cfg.tenants)))
    if cfg.distinct_prompts is None:
        return out
    # narrow: each arrival keeps its time and index and takes one of the templates of its phase
    templates = generate(dataclasses.replace(cfg, distinct_prompts=None, seed=0), n)
    pick = random.Random(cfg.seed + 1)
    return [dataclasses.replace(r, prompt=s.prompt, max_new_tokens=s.max_new_tokens, domain=s.domain,
                                tenant=s.tenant)
            for r in out for s in [_template(templates, r.index, cfg, pick)]]


def _template(out: list[TrafficRequest], i: int, cfg: TrafficConfig, rng: random.Random) -> TrafficRequest:
    """The template arrival ``i`` takes: one of the first ``distinct_prompts`` requests of ``out`` in its phase
    (before or after the domain shift)."""
    shifted = cfg.shift_after is not None and i >= cfg.shift_after
    start = cfg.shift_after if shifted else 0
    end = cfg.shift_after if cfg.shift_after is not None and not shifted else len(out)
    return out[start + rng.randrange(min(cfg.distinct_prompts, end - start))]
