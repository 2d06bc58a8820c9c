"""`moescope top`: a live terminal view of MoE routing health (Textual), usable over SSH at 80x24 at any
model shape (256 experts x 58 layers included).

Rows: source status (each endpoint ok or unreachable; it recovers by itself), health tiles coloured by the
alert rules' judgements (``levels``: green under 2/3 of the bar, yellow under it, red over it; the excess CV
against the imbalance bar, never the raw CV), the routing view with what is judged and what waits,
the selected layer's hottest/coldest experts and all-to-all p99 per rank, and firing alerts from an
Alertmanager. The routing view (``heatmap``) is either the overview, one row per layer with its experts
folded into bands and its verdict (collapsed, imbalanced, dead experts), scrolled and optionally sorted
worst first, or the selected layer's expert bands x time. Polling runs in a worker thread: the UI never waits
on the network. Keys: up/down (pgup/pgdn, home/end) select a layer, enter/tab switch overview and layer
view, [ ] previous/next layer, s sort, space pause, q quit. Everything drawn is ``rich.text.Text`` (no markup
parsing of scraped strings).
"""

from __future__ import annotations

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.widgets import Footer, Static

from moescope.traces.sanitize import sanitize
from moescope.tui import heatmap
from moescope.tui.top_data import Frame, Poller

LEVEL_STYLE = {"ok": "bold green", "warn": "bold yellow", "bad": "bold white on red", "none": "dim"}


def tiles_text(frame: Frame, width: int | None = 80) -> Text:
    """Five tiles a row, ``width`` // 5 cells each; ``width`` None: laid out as at ``heatmap.LAYOUT_WIDTH``, no
    line cut."""
    cell = (width or heatmap.LAYOUT_WIDTH) // 5
    out = Text()
    for i, t in enumerate(frame.tiles):
        label = f"{t.name} "
        out.append(label, style="dim")
        out.append(t.text, style=LEVEL_STYLE[t.level])
        out.append(" " * max(1, cell - len(label) - len(t.text)))
        if i % 5 == 4:
            out.append("\n")
    return heatmap.fit(out, width)


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


def details_text(frame: Frame, layer: int | None, width: int | None = 80) -> Text:
    """The selected layer's named experts; all-to-all p99 per rank and the firing alerts."""
    out = heatmap.details(frame, layer, width)
    out.append("\n")
    if frame.efficiency:
        out.append(frame.efficiency + "\n")
    if frame.ep:
        out.append(frame.ep + "\n")
    if frame.a2a_p99:
        out.append("a2a p99 " + " ".join(f"r{k}:{v * 1e3:.1f}ms" for k, v in frame.a2a_p99.items()) + "  ")
    if frame.alert_error:
        out.append(sanitize(frame.alert_error, keep_newlines=False), style="bold white on red")
    elif frame.alerts:
        out.append("FIRING: " + "; ".join(sanitize(a, keep_newlines=False) for a in frame.alerts), style="bold red")
    else:
        out.append("no alerts firing" if frame.alerts is not None else "", style="green")
    return heatmap.fit(out, width)


class TopApp(App):
    CSS = """
    #status { height: 1; }
    #tiles { height: 2; }
    #heat { height: 1fr; }
    #details { height: 2; }
    """
    BINDINGS = [Binding("q", "quit", "quit"), Binding("tab", "toggle_view", "layer/overview", priority=True),
                Binding("enter", "toggle_view", show=False), Binding("escape", "overview", show=False),
                Binding("up", "move(-1)", show=False), Binding("down", "move(1)", show=False),
                Binding("pageup", "page(-1)", show=False), Binding("pagedown", "page(1)", show=False),
                Binding("home", "move(-10000)", show=False), Binding("end", "move(10000)", show=False),
                Binding("left_square_bracket", "layer(-1)", "prev"),
                Binding("right_square_bracket", "layer(1)", "next"),
                Binding("s", "sort", "sort"), Binding("space", "pause", "pause")]

    def __init__(self, poller: Poller, interval_s: float = 1.0) -> None:
        super().__init__()
        self.poller, self.interval_s = poller, interval_s
        self.frame: Frame | None = None
        self.first_frame: Frame | None = None
        self.layer: int | None = None  # the selected layer (both views)
        self.mode = "overview"  # or "layer"
        self.worst_first = False
        self.offset = 0  # first overview row shown
        self.paused = False
        self._polling = False  # a poll is in flight (set and cleared on the app's thread)
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
        # one poll at a time: a poll slower than the interval (a loaded exporter, a large exposition) makes the
        # next tick wait, never run beside it (the poller keeps the previous scrape for rates: two at once would
        # interleave it). A Textual thread worker cannot be cancelled, so `exclusive` would not prevent that.
        if not self.paused and not self._polling:
            self._polling = True
            self.run_worker(self._poll, thread=True, group="poll")

    def _poll(self) -> None:
        frame = self.poller.poll()
        self.call_from_thread(self.show, frame)

    def show(self, frame: Frame) -> None:
        self._polling = False
        self.frame = frame
        if self.first_frame is None:
            self.first_frame = frame
        self.polls += 1
        if frame.routing and self.layer not in frame.routing:
            self.layer = self._order()[0]
        self.redraw()

    # -- drawing -------------------------------------------------------------------------------------------
    def _order(self) -> list[int]:
        return heatmap.sort_layers(self.frame.routing, self.worst_first) if self.frame else []

    def _rows(self) -> int:
        """Layer rows the overview has room for (its header lines aside)."""
        return max(1, (self.query_one("#heat", Static).size.height or 18) - heatmap.HEADER)

    def _follow(self) -> None:
        """Scroll the overview so the selected layer is on screen."""
        order = self._order()
        if self.layer in order:
            i = order.index(self.layer)
            rows = self._rows()
            self.offset = min(max(self.offset, i - rows + 1), i)
            self.offset = max(0, min(self.offset, len(order) - rows))

    def redraw(self) -> None:
        f = self.frame
        if f is None:
            return
        width = self.size.width or 80
        heat = self.query_one("#heat", Static)
        height = heat.size.height or 18
        self.query_one("#status", Static).update(status_text(f, self.paused))
        self.query_one("#tiles", Static).update(tiles_text(f, width))
        if self.mode == "overview":
            self._follow()
            heat.update(heatmap.overview(f, width, height, self.layer, self.offset, self.worst_first))
        else:
            heat.update(heatmap.layer_view(f, self.layer, width, height))
        self.query_one("#details", Static).update(details_text(f, self.layer, width))

    # -- keys ----------------------------------------------------------------------------------------------
    def _select(self, index: int) -> None:
        order = self._order()
        if order:
            self.layer = order[max(0, min(len(order) - 1, index))]
            self.redraw()

    def action_move(self, step: int) -> None:
        order = self._order()
        if order:
            self._select((order.index(self.layer) if self.layer in order else 0) + step)

    def action_page(self, step: int) -> None:
        self.action_move(step * self._rows())

    def action_layer(self, step: int) -> None:
        """Previous/next layer by layer number, wrapping (in either view)."""
        layers = sorted(self.frame.routing) if self.frame else []
        if layers and self.layer in layers:
            self.layer = layers[(layers.index(self.layer) + step) % len(layers)]
            self.redraw()

    def action_toggle_view(self) -> None:
        self.mode = "layer" if self.mode == "overview" else "overview"
        self.redraw()

    def action_overview(self) -> None:
        self.mode = "overview"
        self.redraw()

    def action_sort(self) -> None:
        self.worst_first = not self.worst_first
        self.offset = 0
        self.redraw()

    def action_pause(self) -> None:
        self.paused = not self.paused
        self.redraw()
