"""Saving and loading model weights: safetensors only (no pickle), config stored in the file's metadata. Importing
this module does not import torch (``read_config`` runs before a first build says it is loading)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from moescope.errors import BadInput
from moescope.runtime.model_config import MoEConfig, from_dict

ASSETS = Path(__file__).resolve().parent.parent / "assets"
DEMO_WEIGHTS = ASSETS / "tiny-demo.safetensors"
MAX_HEADER = 100_000_000  # safetensors' own limit on the JSON header

if TYPE_CHECKING:
    import torch


def save(model: torch.nn.Module, path: str | Path, *, dtype: torch.dtype | None = None,
         extra: dict[str, str] | None = None) -> Path:
    """Write the model's parameters (cast to ``dtype``, float16 by default, to keep the file small) and its
    config."""
    # start-up: torch, safetensors, only when save() runs
    import torch
    from safetensors.torch import save_file

    dtype = torch.float16 if dtype is None else dtype

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # the routers' correction biases stay float32 (they steer selection by small differences)
    tensors = {k: v.detach().to("cpu", torch.float32 if k.endswith("e_score_correction_bias") else dtype).contiguous()
               for k, v in model.state_dict().items()}
    meta = {"moescope_config": json.dumps(model.cfg.to_dict()), **(extra or {})}
    save_file(tensors, str(path), metadata=meta)
    return path


def read_config(path: str | Path) -> MoEConfig:
    """The config stored in a weights file's metadata, read from the safetensors header (an 8-byte little-endian
    length, then that much JSON whose ``__metadata__`` holds it) without torch."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 0 < size <= MAX_HEADER:
                raise ValueError(f"header size {size}")
            meta = json.loads(f.read(size)).get("__metadata__") or {}
    except FileNotFoundError:
        raise BadInput(f"weights file {path} does not exist") from None
    except (OSError, ValueError, AttributeError) as exc:
        raise BadInput(f"weights file {path} is not a readable safetensors file: {exc}") from None
    if "moescope_config" not in meta:
        raise BadInput(f"weights file {path} has no moescope config in its metadata")
    return from_dict(json.loads(meta["moescope_config"]), source=str(path))


def load_into(model: torch.nn.Module, path: str | Path) -> None:
    """Copy the file's tensors into ``model`` (cast to the model's dtype); every name and shape must match."""
    # start-up: torch, safetensors, only when load_into() runs
    import torch
    from safetensors.torch import load_file

    path = Path(path)
    try:
        tensors = load_file(str(path), device="cpu")
    except FileNotFoundError:
        raise BadInput(f"weights file {path} does not exist") from None
    except Exception as exc:
        raise BadInput(f"weights file {path} is not a readable safetensors file: {exc}") from None
    state = model.state_dict()
    missing, unexpected = set(state) - set(tensors), set(tensors) - set(state)
    if missing or unexpected:
        raise BadInput(f"weights file {path} does not fit the model: missing {sorted(missing)[:3]}, "
                       f"unexpected {sorted(unexpected)[:3]}")
    for name, value in tensors.items():
        if value.shape != state[name].shape:
            raise BadInput(f"weights file {path}: {name} has shape {tuple(value.shape)}, "
                           f"model expects {tuple(state[name].shape)}")
    with torch.no_grad():
        for name, value in tensors.items():
            state[name].copy_(value.to(state[name].dtype))
