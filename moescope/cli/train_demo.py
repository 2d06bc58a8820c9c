"""``moescope train-demo``: retrain the bundled tiny demo model (a few minutes on 2 CPU cores)."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("train-demo")
@click.option("--steps", type=click.IntRange(min=1), default=None, help="Optimiser steps (default 800).")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Where to write the safetensors file (default: the bundled asset).")
def train_demo(steps: int | None, out: Path | None) -> None:
    """Train the tiny demo model on local text (stdlib code and docstrings, numbers, unicode)."""
    import dataclasses

    from moescope.runtime import train, weights

    cfg = train.TrainConfig() if steps is None else dataclasses.replace(train.TrainConfig(), steps=steps)
    card = train.main(out or weights.DEMO_WEIGHTS, cfg, log=lambda m: click.echo(m, err=True))
    for layer, jsd in card["specialisation"]["mean_pairwise_jsd_bits"].items():
        click.echo(f"layer {layer}: mean pairwise JS divergence of expert load between domains {jsd:.3f} bits")
