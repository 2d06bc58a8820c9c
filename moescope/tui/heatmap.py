"""What `moescope top` draws for routing, as ``rich.text.Text``: pure functions of a ``Frame``, no app state.

- ``overview``: a header (shape and legend; the model in one line; what is judged against what and what
  waits), then one row per MoE layer (scrolled), its experts folded into bands: each cell is the band's
  busiest expert against the fair share 1/E (``levels.SHADES``: ``=`` fair, each step a doubling; ``_`` an
  expert the exporter judged dead, blank no data), then the layer's verdict or its excess CV against its bar
  and hottest experts. Rows sort by layer or worst first; the selected row is reversed.
- ``layer_view``: one layer's expert bands x time (each column one poll), each band's load against its fair
  share, with the band's hottest expert named on the right.

Verdicts come from ``routing.layer_routing`` (the thresholds object's methods over the exporter's judged
series); nothing here judges by a number of its own.
"""

from __future__ import annotations

import math

from rich.text import Text

from moescope.tui import levels
from moescope.tui.routing_view import Band, LayerRouting, fold

LEVEL_STYLE = {"ok": "green", "warn": "bold yellow", "bad": "bold white on red", "none": "dim"}
ANNOTATION = 38  # characters right of the cells
LAYOUT_WIDTH = 80  # the cells' room when no width is given (plain text, piped): lines are then not cut
HEADER = 3  # the overview's header lines: shape and legend, the model in one line, what is judged


def cell(rel: float | None) -> tuple[str, str]:
    """(character, style) of one cell: ``rel`` = load / fair load; None or NaN (a layer without load) = no data."""
    if rel is None or math.isnan(rel):
        return " ", ""
    if rel <= 0:
        return "_", "blue"
    i = levels.FAIR_SHADE + round(math.log2(rel))
    style = next(colour for bound, colour in levels.RAMP if rel < bound)
    return levels.SHADES[min(len(levels.SHADES) - 1, max(0, i))], style


def band_cell(b: Band, judged: bool) -> tuple[str, str]:
    """A band of experts: a hot expert shows through (its own load, once it reaches the hot colour), else an
    expert with no slot (``_``, where the window is enough to judge), else the band's mean load."""
    if b.rel_max >= levels.HOT:
        return cell(b.rel_max)
    if b.zeros and judged:
        return cell(0.0)
    return cell(b.rel_sum)


def n_bands(n_experts: int, room: int) -> int:
    """Bands that fit ``room`` characters: one expert per cell when they fit, else equal bands."""
    if n_experts <= room:
        return n_experts
    per = -(-n_experts // room)
    return -(-n_experts // per)


def sort_layers(routing: dict[int, LayerRouting], worst_first: bool) -> list[int]:
    order = ("bad", "warn", "ok", "none")
    if not worst_first:
        return sorted(routing)
    return sorted(routing, key=lambda la: (order.index(routing[la].level), -routing[la].severity, la))


def rel(v: float) -> str:
    """A load against the fair share: ``1.3x``, ``32x``."""
    return f"{v:.1f}x" if v < 10 else f"{v:.0f}x"


def _hot_words(r: LayerRouting, n: int = 1) -> str:
    return " ".join(f"e{e} {rel(v)}" for e, v in r.hot[:n])


def fit(text: Text, width: int | None) -> Text:
    """``text`` with every line cut to ``width`` cells (a terminal of that width shows it as is); ``None``: every
    line whole (plain text piped to a file or a program)."""
    if width is None:
        return text
    out = Text()
    for i, line in enumerate(text.split("\n", allow_blank=True)):
        line.truncate(width, overflow="ellipsis")
        if i:
            out.append("\n")
        out.append_text(line)
    return out


def annotation(r: LayerRouting) -> Text:
    out = Text()
    if r.verdict:
        out.append(r.verdict, style=LEVEL_STYLE[r.level])
        if r.hot and "onto" not in r.verdict and not r.hot_factors:
            out.append(f"; hot {_hot_words(r)}")
        return out
    if r.excess_cv is not None and not r.judged:
        out.append("not judged (too few requests)", style="dim")
    elif r.judged:
        out.append("xcv ", style="dim")
        out.append(f"{r.excess_cv:.2f}<{r.bar:.2f}", style=LEVEL_STYLE[r.level])
    else:
        out.append("cv ", style="dim")
        out.append("-" if r.cv is None else f"{r.cv:.2f}", style="dim")
    if r.hot:
        out.append(f" hot {_hot_words(r, 2)}")
    if r.dead is not None:
        out.append(f" dead {r.dead}" if _dead_shown(r) else f" no slot {r.dead}" if r.dead else " dead 0")
    return out


def summary_line(routing: dict[int, LayerRouting]) -> Text:
    """The whole model in one line: the worst layer in words, then how many layers are in each state."""
    if not routing:
        return Text("waiting for routing data ...", style="dim")
    worst = sort_layers(routing, True)[0]
    r = routing[worst]
    bad = sum(1 for x in routing.values() if x.level == "bad")
    dead = sum(1 for x in routing.values() if levels.finite(x.dead_unexpected) and x.dead_unexpected > 0)
    out = Text()
    if r.verdict:
        out.append(f"worst L{worst}: {r.verdict}", style=LEVEL_STYLE[r.level])
    else:
        out.append("every layer within its bars", style="green")
    out.append(f"; {bad}/{len(routing)} layers over a bar, {dead} with dead")
    return out


def _dead_shown(r: LayerRouting) -> bool:
    """Zero-slot experts are drawn as dead only where the exporter judged the layer's dead experts unexpected."""
    return levels.finite(r.dead_unexpected) and r.dead_unexpected > 0


def overview(frame, width: int | None, height: int, selected: int | None = None, offset: int = 0,
             worst_first: bool = False) -> Text:
    """Header (2 lines) + one row per layer from ``offset`` (``height`` lines in all; 0 = every layer).
    ``width`` None: the cells as at ``LAYOUT_WIDTH``, no line cut."""
    routing = frame.routing
    if not routing:
        return Text("waiting for routing data ...", style="dim")
    n_exp = frame.n_experts or 0
    bands = n_bands(n_exp, max(8, (width or LAYOUT_WIDTH) - ANNOTATION - 6)) if n_exp else 0
    per = -(-n_exp // bands) if bands else 0
    what = (f"bands of {per}" if per > 1 else "a cell per expert") if bands else "no expert data"
    if frame.tier != "per-expert" and bands:
        what += " sorted by load"  # past the cardinality budget: the exporter's histogram, not expert ids
    out = Text(f"{len(routing)} layers x {n_exp or '?'} experts, {what} ({frame.tier}, {frame.window}); "
               f"{levels.SHADES[levels.FAIR_SHADE]} fair, x2 a step\n", style="bold")
    out.append_text(summary_line(routing))
    out.append("\n")
    out.append(frame.judged + "\n", style="dim")
    layers = sort_layers(routing, worst_first)
    rows = layers[offset: offset + max(1, height - HEADER)] if height else layers
    for layer in rows:
        r = routing[layer]
        label = Text(f"L{layer:<4}", style=LEVEL_STYLE[r.level] if r.level in ("warn", "bad") else "bold")
        if layer == selected:
            label.stylize("reverse")
        out.append_text(label)
        cells = r.counts if r.counts is not None and r.counts.sum() > 0 else r.profile
        if cells is not None:
            judged = _dead_shown(r)
            for b in fold(cells, bands):
                ch, style = band_cell(b, judged)
                out.append(ch, style=style)
        else:
            out.append(" " * bands)
        out.append(" ")
        out.append_text(annotation(r))
        out.append("\n")
    return fit(out, width)


def layer_view(frame, layer: int | None, width: int, height: int) -> Text:
    """One layer's expert bands x time: each column one poll (newest right), each cell the band's share of that
    poll's slots against its fair share; the band's hottest expert over the window named on the right."""
    if layer is None or layer not in frame.routing:
        return Text("waiting for routing data ...", style="dim")
    r = frame.routing[layer]
    layers = sorted(frame.routing)
    cols = [c for c in frame.columns.get(layer, ()) if c.sum() > 0]
    out = Text(f"layer {layer} ({layers.index(layer) + 1}/{len(layers)}; [ ] switch, tab overview): expert bands "
               f"x time\n", style="bold")
    out.append_text(annotation(r))
    out.append("\n")
    if r.counts is None or not frame.n_experts:
        out.append("(no per-expert series in this tier: the verdict comes from the layer's gauges)", style="dim")
        return out
    n_rows = max(1, min(frame.n_experts, height - 2))
    window = fold(r.counts, n_rows)
    per = window[0].hi - window[0].lo
    label = max(len(b.name) for b in window)
    n_cols = max(1, width - label - 1 - 20)
    cols = cols[-n_cols:]
    folded = [fold(c, n_rows) for c in cols]
    judged = _dead_shown(r)
    for i, b in enumerate(window):
        out.append(f"{b.name:>{label}} ", style="dim")
        for f in folded:
            ch, style = cell(f[i].rel_sum)
            out.append(ch, style=style)
        out.append(" " * (n_cols - len(cols)) + " ")
        if b.rel_sum > 0:
            out.append(f"e{b.hottest} {rel(b.rel_max)}" if per > 1 else rel(b.rel_max))
        if b.zeros and judged:
            out.append(f" {b.zeros} dead" if per > 1 else " dead", style="blue")
        out.append("\n")
    return fit(out, width)


def details(frame, layer: int | None, width: int | None = 80) -> Text:
    """The selected layer's hottest and coldest experts (one line)."""
    out = Text()
    r = frame.routing.get(layer) if layer is not None else None
    if r is not None and (r.hot or r.cold):
        out.append(f"L{layer} hot " + " ".join(f"e{e} {rel(v)}" for e, v in r.hot))
        out.append(" | cold " + " ".join(f"e{e} {rel(v)}" for e, v in r.cold))
        dead = r.dead_unexpected if levels.finite(r.dead_unexpected) else None
        out.append(f" | dead {int(dead) if dead is not None else '-'}")
        for e, f, ref in r.hot_factors:
            out.append(f" | L{layer} E{e} {f:.1f}x {ref}", style="bold red")
    return fit(out, width)
