"""`moescope top`: a live terminal view of MoE routing health (Textual), usable over SSH at 80x24.

Rows: source status (each endpoint ok or unreachable; it recovers by itself), health tiles coloured by the
alert thresholds (green under 2/3 of the bar, yellow under it, red over it), the expert x time heatmap of
the selected layer (each column one poll; shade = the expert's share against the fair share 1/E), the
hottest and dead experts, all-to-all p99 per rank, and firing alerts from an Alertmanager. Polling runs in
a worker thread: the UI never waits on the network. Keys: [ and ] (or 1-9) pick the layer, space pauses,
q quits. Everything drawn is ``rich.text.Text`` (no markup parsing of scraped strings).
"""

from __future__ import annotations

from collections import deque

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.widgets import Footer, Static

from moescope.traces.sanitize import sanitize
from moescope.tui.top_data import Frame, Poller

LEVEL_STYLE = {"ok": "bold green", "warn": "bold yellow", "bad": "bold white on red", "none": "dim"}
SHADES = " .:-=+*#%@"  # ASCII ramp: readable over any SSH terminal and font
HISTORY = 64


def tiles_text(frame: Frame, width: int = 80) -> Text:
    cell = max(12, width // 5)
    out = Text()
    for i, t in enumerate(frame.tiles):
        label = f"{t.name} "
        out.append(label, style="dim")
        out.append(t.text, style=LEVEL_STYLE[t.level])
        out.append(" " * max(1, cell - len(label) - len(t.text)))
        if i % 5 == 4:
            out.append("\n")
    return out


def heatmap_text(columns: deque, layer: int | None, n_layers: list[int], width: int = 70) -> Text:
    if layer is None or not columns:
        return Text("waiting for routing data ...", style="dim")
    cols = list(columns)[-width:]
    n_exp = max(len(c) for c in cols)
    groups = min(n_exp, 16)  # many experts: rows are groups of experts (max over the group)
    per = -(-n_exp // groups)
    out = Text(f"layer {layer} ({', '.join(map(str, n_layers))}: [ ] to switch)  expert x time, share vs 1/{n_exp}\n",
               style="bold")
    for g in range(groups):
        lo, hi = g * per, min(n_exp, (g + 1) * per)
        name = f"e{lo}" if hi - lo == 1 else f"e{lo}-{hi - 1}"
        out.append(f"{name:>7} ", style="dim")
        for c in cols:
            tot = sum(c)
            share = max(c[lo:hi]) / tot if tot > 0 and lo < len(c) else 0.0
            rel = share * n_exp  # 1.0 = fair share
            idx = min(len(SHADES) - 1, int(rel * 3)) if tot > 0 else 0
            style = "red" if rel > 2.5 else "yellow" if rel > 1.5 else "green" if rel > 0.5 else "blue"
            out.append(SHADES[idx], style=style)
        out.append("\n")
    return out


def status_text(frame: Frame, paused: bool) -> Text:
    out = Text()
    out.append(f"moescope top  {frame.model or '-'}  ", style="bold")
    for url, st in frame.endpoints.items():
        out.append(sanitize(url, keep_newlines=False) + " ")
        out.append("ok" if st == "ok" else sanitize(st, keep_newlines=False)[:60],
                   style="green" if st == "ok" else "bold white on red")
        out.append("  ")
    if paused:
        out.append("[paused]", style="yellow")
    return out


def details_text(frame: Frame, layer: int | None) -> Text:
    out = Text()
    if layer is not None and layer in frame.hottest:
        out.append(f"hottest {frame.hottest[layer]}  dead {frame.dead.get(layer, 0)}  ")
    if frame.a2a_p99:
        out.append("a2a p99 " + " ".join(f"r{r}:{v * 1e3:.1f}ms" for r, v in frame.a2a_p99.items()))
    out.append("\n")
    if frame.alert_error:
        out.append(sanitize(frame.alert_error, keep_newlines=False), style="bold white on red")
    elif frame.alerts:
        out.append("FIRING: " + "; ".join(sanitize(a, keep_newlines=False) for a in frame.alerts), style="bold red")
    else:
        out.append("no alerts firing" if frame.alerts is not None else "", style="green")
    return out


class TopApp(App):
    CSS = """
    #status { height: 1; }
    #tiles { height: 2; }
    #heat { height: 1fr; }
    #details { height: 2; }
    """
    BINDINGS = [Binding("q", "quit", "quit"), Binding("left_square_bracket", "layer(-1)", "prev layer"),
                Binding("right_square_bracket", "layer(1)", "next layer"), Binding("space", "pause", "pause")] + \
        [Binding(str(i), f"pick({i})", show=False) for i in range(1, 10)]

    def __init__(self, poller: Poller, interval_s: float = 1.0) -> None:
        super().__init__()
        self.poller, self.interval_s = poller, interval_s
        self.frame: Frame | None = None
        self.first_frame: Frame | None = None
        self.history: dict[int, deque] = {}
        self.layer: int | None = None
        self.paused = False
        self.polls = 0

    def compose(self) -> ComposeResult:
        yield Static(Text("connecting ..."), id="status")
        yield Static(Text(""), id="tiles")
        yield Static(Text(""), id="heat")
        yield Static(Text(""), id="details")
        yield Footer()

    def on_mount(self) -> None:
        self.set_interval(self.interval_s, self._tick)
        self._tick()

    def _tick(self) -> None:
        if not self.paused:
            self.run_worker(self._poll, thread=True, exclusive=True, group="poll")

    def _poll(self) -> None:
        frame = self.poller.poll()
        self.call_from_thread(self.show, frame)

    def show(self, frame: Frame) -> None:
        self.frame = frame
        if self.first_frame is None:
            self.first_frame = frame
        self.polls += 1
        for layer, rates in frame.expert_rate.items():
            if any(rates):
                self.history.setdefault(layer, deque(maxlen=HISTORY)).append(rates)
        layers = sorted(frame.expert_rate)
        if self.layer not in layers:
            self.layer = layers[0] if layers else None
        self.redraw()

    def redraw(self) -> None:
        f = self.frame
        if f is None:
            return
        width = self.size.width or 80
        self.query_one("#status", Static).update(status_text(f, self.paused))
        self.query_one("#tiles", Static).update(tiles_text(f, width))
        self.query_one("#heat", Static).update(heatmap_text(self.history.get(self.layer, deque()), self.layer,
                                                            sorted(f.expert_rate), max(10, width - 10)))
        self.query_one("#details", Static).update(details_text(f, self.layer))

    def action_layer(self, step: int) -> None:
        layers = sorted(self.frame.expert_rate) if self.frame else []
        if layers and self.layer in layers:
            self.layer = layers[(layers.index(self.layer) + step) % len(layers)]
            self.redraw()

    def action_pick(self, n: int) -> None:
        layers = sorted(self.frame.expert_rate) if self.frame else []
        if 0 < n <= len(layers):
            self.layer = layers[n - 1]
            self.redraw()

    def action_pause(self) -> None:
        self.paused = not self.paused
        self.redraw()
