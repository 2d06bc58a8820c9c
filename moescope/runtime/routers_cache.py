"""Where a shape's balanced routers (``runtime.balance``) are found, and whether a build will have to make them,
answered without torch: the CLI says that a first build is coming before it pays torch's import (seconds on a
loaded machine), so a first run at a production shape shows progress at once.

Two places, by the same file name (``routers-<key>.safetensors``, the key from the shape and seed):
the package's ``assets/`` (the production-shape presets' routers, shipped: a first run at deepseek-v3-shape
loads them instead of calibrating) and the user's cache (every other shape, written by the first build).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from moescope import user_cache
from moescope.progress import note
from moescope.runtime import weights as weights_io
from moescope.runtime.model_config import MoEConfig, resolve

BALANCE_VERSION = 3  # bump when the procedure changes: cached or shipped results of an older one are not reused
SHIPPED = weights_io.ASSETS


def cache_dir() -> Path:
    """Where balanced routers are cached: ``balanced-routers/`` in the user's cache (``moescope.user_cache.root``:
    ``$MOESCOPE_CACHE``, else ``$XDG_CACHE_HOME/moescope``, else ``~/.cache/moescope``)."""
    return user_cache.root() / "balanced-routers"


def file_name(cfg: MoEConfig, seed: int) -> str:
    """The routers' file name for this shape and seed. The name is a label (a renamed preset has the same
    weights) and the capacity factor a serving setting: neither is in the key. The file also records a
    fingerprint of the init the seed produced (``balance``), checked on load: another torch's RNG would give
    other hidden states, and the routers would be recomputed."""
    shape = {k: v for k, v in cfg.to_dict().items() if k not in ("capacity_factor", "name")}
    text = json.dumps([BALANCE_VERSION, shape, seed], sort_keys=True)
    return f"routers-{hashlib.sha256(text.encode()).hexdigest()[:16]}.safetensors"


def found(cfg: MoEConfig, seed: int) -> list[Path]:
    """The existing files for this shape and seed, shipped first."""
    name = file_name(cfg, seed)
    return [p for p in (SHIPPED / name, cache_dir() / name) if p.is_file()]


def to_balance(model: str, weights: str | None, **overrides) -> MoEConfig | None:
    """The config whose routers ``loader.build_model(model, weights=weights, **overrides)`` balances, or None
    where it loads weights (a ``.safetensors`` model, a weights file, or, for a model whose config is the shipped
    weights' under any name, those weights) or builds a plain random init (``weights=None``)."""
    if weights != "auto" or model.endswith(".safetensors"):
        return None
    cfg = resolve(model)
    shipped = weights_io.read_config(weights_io.DEMO_WEIGHTS)  # torch-free: the header's config
    if cfg.replace(name=shipped.name) == shipped:
        return None
    return cfg.replace(**overrides) if overrides else cfg


def announce(model: str, weights: str | None, **overrides) -> None:
    """One line on stderr before a build whose routers are balanced (``to_balance``), saying where they come
    from. Torch-free: commands call it first, so a user sees progress within a second of the start, before
    torch's import and the model's init (seconds each at a production shape on a loaded machine)."""
    cfg = to_balance(model, weights, **overrides)
    if cfg is None:
        return
    files = found(cfg, cfg.seed)
    size = f"{cfg.n_layers} layers x {cfg.n_experts} experts"
    if not files:
        note(f"building {cfg.name} ({size}): first build of its shape, balancing its routers once (then cached "
             f"in {cache_dir()}) ...")
    else:
        where = "shipped with moescope" if files[0].parent == SHIPPED else f"cached in {files[0].parent}"
        note(f"building {cfg.name} ({size}; its balanced routers {where}) ...")
