"""The report's figures (matplotlib, Agg): one layers x experts overview, and per-layer heatmaps on request.

Legible at any shape: tick labels are thinned to about a dozen per axis (every expert of 8, every 32nd of
256), colours are load against the fair share 1/E on a log2 scale centred on fair (blue under, red over),
and an expert with no slot is drawn in black, so hot, dead and collapsed read at a glance.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

MAX_TICKS = 12
SPAN = 3  # the colour scale covers 1/8x .. 8x the fair share (log2 -3 .. 3); beyond it saturates


def _pyplot():
    import matplotlib  # optional: matplotlib (the analysis extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional: matplotlib (the analysis extra)

    return plt


def ticks(n: int, labels: list | None = None, most: int = MAX_TICKS,
          steps: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)) -> tuple[list[int], list[str]]:
    """Positions and labels of at most ``most`` ticks over ``n`` cells, at labels that are multiples of a round
    step (experts: powers of two; layers pass ``(1, 2, 5, 10, 20, 50)``)."""
    labels = list(range(n)) if labels is None else labels
    step = next((s for s in steps if n / s <= most), max(1, -(-n // most)))
    pos = [i for i, v in enumerate(labels) if isinstance(v, int) and v % step == 0] if labels else []
    if not pos or len(pos) > most + 1:
        pos = list(range(0, n, step))
    return pos, [str(labels[i]) for i in pos]


def _relative(m: np.ndarray) -> np.ma.MaskedArray:
    """log2(load / fair load) per row (rows: layers, passes ...; columns: experts); zeros masked (drawn black)."""
    tot = m.sum(1, keepdims=True)
    fair = np.where(tot > 0, tot / m.shape[1], 1.0)
    with np.errstate(divide="ignore"):
        rel = np.log2(np.where(m > 0, m / fair, 1.0))
    return np.ma.masked_array(np.clip(rel, -SPAN, SPAN), mask=(m == 0) & (tot > 0))


def _draw(ax, rel: np.ma.MaskedArray):
    plt = _pyplot()
    cmap = plt.get_cmap("RdBu_r").with_extremes(bad="black")
    return ax.imshow(rel, aspect="auto", cmap=cmap, vmin=-SPAN, vmax=SPAN, interpolation="nearest",
                     origin="lower")


def _colorbar(fig, im, ax) -> None:
    bar = fig.colorbar(im, ax=ax, label="load / fair share (black: no slot)")
    bar.set_ticks(list(range(-SPAN, SPAN + 1)))
    bar.set_ticklabels([f"1/{2 ** -v}x" if v < 0 else f"{2 ** v}x" for v in range(-SPAN, SPAN + 1)])


def overview(load: dict[int, np.ndarray], path: Path, title: str) -> None:
    """Layers (rows) x experts (columns): each expert's load over the whole window against the fair share."""
    plt = _pyplot()
    layers = sorted(load)
    m = np.stack([load[layer] for layer in layers]).astype(float)
    fig, ax = plt.subplots(figsize=(10, 2.2 + 0.08 * len(layers)), dpi=100)
    im = _draw(ax, _relative(m))
    x, xl = ticks(m.shape[1])
    y, yl = ticks(len(layers), layers, steps=(1, 2, 5, 10, 20, 50))
    ax.set_xticks(x, xl)
    ax.set_yticks(y, yl)
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    ax.set_title(title)
    _colorbar(fig, im, ax)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def layer_heatmap(matrix: np.ndarray, path: Path, title: str, xlabel: str, xlabels: list | None = None) -> None:
    """One layer: experts (rows) x columns (passes or domains), each column against its own fair share."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=100)
    im = _draw(ax, _relative(matrix.T.astype(float)).T)
    x, xl = ticks(matrix.shape[1], xlabels)
    y, yl = ticks(matrix.shape[0])
    ax.set_xticks(x, xl, rotation=30 if xlabels is not None else 0, ha="right" if xlabels is not None else "center")
    ax.set_yticks(y, yl)
    ax.set_ylabel("expert")
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    _colorbar(fig, im, ax)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
