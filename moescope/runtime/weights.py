"""Saving and loading model weights: safetensors only (no pickle), config stored in the file's metadata."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from moescope.errors import BadInput
from moescope.runtime.config import MoEConfig, from_dict

ASSETS = Path(__file__).resolve().parent.parent / "assets"
DEMO_WEIGHTS = ASSETS / "tiny-demo.safetensors"


def save(model: torch.nn.Module, path: str | Path, *, dtype: torch.dtype = torch.float16,
         extra: dict[str, str] | None = None) -> Path:
    """Write the model's parameters (cast to ``dtype`` to keep the file small) and its config."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # the routers' correction biases stay float32 (they steer selection by small differences)
    tensors = {k: v.detach().to("cpu", torch.float32 if k.endswith("e_score_correction_bias") else dtype).contiguous()
               for k, v in model.state_dict().items()}
    meta = {"moescope_config": json.dumps(model.cfg.to_dict()), **(extra or {})}
    save_file(tensors, str(path), metadata=meta)
    return path


def read_config(path: str | Path) -> MoEConfig:
    """The config stored in a weights file's metadata."""
    from safetensors import safe_open

    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except FileNotFoundError:
        raise BadInput(f"weights file {path} does not exist") from None
    except Exception as exc:
        raise BadInput(f"weights file {path} is not a readable safetensors file: {exc}") from None
    if "moescope_config" not in meta:
        raise BadInput(f"weights file {path} has no moescope config in its metadata")
    return from_dict(json.loads(meta["moescope_config"]), source=str(path))


def load_into(model: torch.nn.Module, path: str | Path) -> None:
    """Copy the file's tensors into ``model`` (cast to the model's dtype); every name and shape must match."""
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
