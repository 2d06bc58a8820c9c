"""The trace viewer's token x layer grid, as ``rich.text.Text``: pure functions of a trace document
(``store.load_request``), no app state.

One row per token (index, phase, text), one cell per MoE layer. A cell's colour is the token's top-1 expert at
that layer, by group of E/8 consecutive experts (so a token that keeps to one part of the expert space reads as
one colour across the layers), its character the router's confidence (normalised entropy, on this
request's own scale: ``@`` its surest decisions .. ``.`` its least sure); anomalies override: ``x`` a dropped
slot, ``!`` non-finite logits, a yellow background a cache miss. Token text is sanitised.
"""

from __future__ import annotations

import math

from rich.text import Text

from moescope.traces.sanitize import sanitize

CONFIDENCE = "@#*+-."  # normalised router entropy 0 .. 1, in equal steps
GROUP_COLOURS = ("red", "green", "blue", "magenta", "cyan", "yellow", "bright_white", "bright_black")
LABEL = 14  # "  12 dec abc  " before the cells


def labels(doc: dict) -> str:
    """The request's domain and tenant, each only when set (a served request usually has neither), sanitised:
    ``"domain code  tenant acme"``, ``"tenant acme"`` or ``""``."""
    return "  ".join(f"{k} {sanitize(doc[k], keep_newlines=False)}" for k in ("domain", "tenant") if doc.get(k))


def token_label(tok: dict) -> str:
    text = sanitize(tok["text"], keep_newlines=False)[:4]
    return f"{tok['index']:>4} {tok['phase'][:3]} {text:<4} "


def entropy_scale(doc: dict) -> tuple[float, float]:
    """(low, high) normalised entropy of the request's decisions (5th, 95th percentile): a 256-expert router's
    entropies all sit near 1, so the characters spread over the range the request actually used."""
    import numpy as np  # start-up: numpy, only when entropy_scale() runs

    ents = [la["entropy"] for tok in doc["tokens"] for la in tok["layers"]]
    vals = np.array([e for e in ents if e is not None and math.isfinite(e)], dtype=float)
    if not len(vals):
        return 0.0, 1.0
    lo, hi = np.percentile(vals, [5, 95])
    return float(lo), float(max(hi, lo + 1e-6))


def layer_times(doc: dict, tok: dict, layer: int) -> list:
    """[router, experts, all-to-all] seconds of the token's step at ``layer`` (None where not measured)."""
    if "step" not in tok or not doc["steps"]:
        return [None, None, None]
    return (doc["steps"][tok["step"]].get("layer_s") or {}).get(str(layer), [None, None, None])


def cell(doc: dict, la: dict, scale: tuple[float, float] = (0.0, 1.0)) -> tuple[str, str]:
    """(character, style) of one token's routing at one layer; ``scale``: the entropy range mapped onto the
    confidence characters."""
    n_exp = doc["n_experts"]
    if n_exp in la["experts"]:  # the sentinel id: a dropped slot
        return "x", "bold white on red"
    ent = la["entropy"]
    if ent is None or not math.isfinite(ent):
        return "!", "bold white on red"
    top = la["experts"][max(range(len(la["weights"])), key=lambda s: la["weights"][s])] if la["weights"] else 0
    groups = len(GROUP_COLOURS)
    colour = GROUP_COLOURS[min(groups - 1, top * groups // max(1, n_exp))]
    lo, hi = scale
    ch = CONFIDENCE[min(len(CONFIDENCE) - 1, max(0, int((ent - lo) / (hi - lo) * len(CONFIDENCE))))]
    return ch, colour + (" on yellow" if la["misses"] else "")


def legend(doc: dict) -> Text:
    """One line: the colours' expert groups (each group's first expert, in its colour) and the characters."""
    n = doc["n_experts"]
    groups = min(len(GROUP_COLOURS), n)
    out = Text("top-1 expert from ", style="dim")
    for g in range(groups):
        out.append(f"e{g * n // groups} ", style=GROUP_COLOURS[g])
    out.append(f"| {CONFIDENCE[0]} sure {CONFIDENCE[-1]} unsure x drop ! NaN ", style="dim")
    out.append("miss", style="on yellow")
    return out


def layer_ruler(layers: list[int], first: int, n: int) -> Text:
    """A line naming every fifth layer above its column."""
    line = [" "] * n
    for j in range(first, min(len(layers), first + n)):
        if (j - first) % 5 == 0:
            label = f"L{layers[j]}"
            for k, ch in enumerate(label):
                if j - first + k < n:
                    line[j - first + k] = ch
    return Text(" " * LABEL + "".join(line), style="dim")


def grid(doc: dict, row: int, col: int, first_row: int, n_rows: int, first_col: int, n_cols: int,
         scale: tuple[float, float] = (0.0, 1.0)) -> Text:
    """Rows ``first_row`` .. ``+n_rows`` and layers ``first_col`` .. ``+n_cols``; the selected cell (``row``,
    ``col``) is reversed, its row label bold."""
    out = layer_ruler(doc["layers"], first_col, n_cols)
    out.append("\n")
    for i in range(first_row, min(len(doc["tokens"]), first_row + n_rows)):
        tok = doc["tokens"][i]
        out.append(token_label(tok), style="bold reverse" if i == row else ("red" if tok["flags"] else ""))
        if not tok["layers"]:
            out.append("(no routing: the last generated token is never fed back)", style="dim")
        for j in range(first_col, min(len(tok["layers"]), first_col + n_cols)):
            ch, style = cell(doc, tok["layers"][j], scale)
            out.append(ch, style=style + (" reverse" if (i, j) == (row, col) else ""))
        out.append("\n")
    return out


def _ms(x) -> str:
    return f"{x * 1e3:.2f}" if isinstance(x, (int, float)) else "-"


def details(doc: dict, row: int, col: int) -> Text:
    """The selected token at the selected layer, in words (three lines)."""
    tok = doc["tokens"][row]
    out = Text(f"token {tok['index']} {sanitize(tok['text'], keep_newlines=False)!r} {tok['phase']}", style="bold")
    if tok["latency_s"] is not None:
        out.append(f" {_ms(tok['latency_s'])} ms")
    if tok["flags"]:
        out.append(" " + ",".join(tok["flags"]), style="bold red")
    if not tok["layers"]:
        out.append("  (no routing: the last generated token is never fed back)", style="dim")
        return out
    la = tok["layers"][col]
    out.append(f"  layer {la['layer']} ({col + 1}/{len(doc['layers'])})  entropy {la['entropy']:.2f} "
               f"margin {la['margin']:.2f}\n")
    for s, (e, w) in enumerate(zip(la["experts"], la["weights"])):
        style = "bold white on red" if e == doc["n_experts"] else "black on yellow" if s in la["misses"] else "bold"
        out.append("drop" if e == doc["n_experts"] else f"e{e}", style=style)
        out.append(f" {w:.2f} ".replace("0.", "."))
    router, experts, a2a = layer_times(doc, tok, la["layer"])
    out.append(f"\nrouter {_ms(router)} ms  experts {_ms(experts)} ms  a2a {_ms(a2a)} ms  rank {doc['rank']}",
               style="dim")
    return out
