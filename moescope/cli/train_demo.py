"""``moescope train-demo``: retrain the tiny demo model (a few minutes on 2 CPU cores) into a file of your own;
the bundled one inside the package is replaced only when ``--out`` names it."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import click


def default_out() -> Path:
    """``$XDG_DATA_HOME/moescope/tiny-demo.safetensors`` (``~/.local/share/...``): a user path, read at call time."""
    data = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(data) / "moescope" / "tiny-demo.safetensors"


@click.command("train-demo")
@click.option("--steps", type=click.IntRange(min=1), default=None, help="Optimiser steps (default 800).")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Where to write the safetensors file (and its .json card) [~/.local/share/moescope/"
                   "tiny-demo.safetensors]; the bundled asset is replaced only when this names it.")
def train_demo(steps: int | None, out: Path | None) -> None:
    """Train the tiny demo model on local text (stdlib code and docstrings, numbers, unicode); use the result with
    `--weights FILE`."""
    # start-up: numpy, torch (runtime.train), only when the command runs, not for --help
    from moescope.runtime import train

    out = out or default_out()
    out.parent.mkdir(parents=True, exist_ok=True)
    cfg = train.TrainConfig() if steps is None else dataclasses.replace(train.TrainConfig(), steps=steps)
    card = train.main(out, cfg, log=lambda m: click.echo(m, err=True))
    for layer, jsd in card["specialisation"]["mean_pairwise_jsd_bits"].items():
        click.echo(f"layer {layer}: mean pairwise JS divergence of expert load between domains {jsd:.3f} bits")
    click.echo(f"use it with: moescope demo --weights {out}")
