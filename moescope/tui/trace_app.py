"""`moescope trace` as a Textual app: a thin view over one request's trace document (``store.load_request``).

Layout (fits 80x24 at any shape, 58 layers included): request header, a latency sparkline, the token x layer
grid of routing (``trace_grid``: one row per token, one cell per MoE layer, scrolled both ways) and the
selected cell in words. Enter opens the selected token's table (every layer: experts, weights, entropy,
margin, cache, timings) and its step's timeline; Enter or Escape goes back to the grid. Keys (footer): arrows
move (pgup/pgdn, home/end), n / p next / previous anomaly, / search token text, c copy the request id, q quit.
All text shown passes through ``sanitize`` and is rendered as ``rich.text.Text`` (never parsed as markup).
"""

from __future__ import annotations

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.widgets import DataTable, Footer, Input, Sparkline, Static

from moescope.traces.sanitize import sanitize
from moescope.tui import trace_grid


def _ms(x) -> str:
    return f"{x * 1e3:.2f}" if isinstance(x, (int, float)) else "-"


def header_text(doc: dict) -> Text:
    t = doc["timings"]
    flags = ",".join(doc["flags"]) or "-"
    tags = trace_grid.labels(doc)
    return Text(
        f"{sanitize(doc['request_id'])}  {doc['model']}  rank {doc['rank']}  {tags + '  ' if tags else ''}"
        f"flags {flags}\n"
        f"queue {_ms(t['queue_s'])} ms  prefill {_ms(t['prefill_s'])} ms  ttft {_ms(t['ttft_s'])} ms  "
        f"total {_ms(t['total_s'])} ms\n"
        f"prompt: {sanitize(doc['prompt'], keep_newlines=False)[:300]}\n"
        f"output: {sanitize(doc['output'], keep_newlines=False)[:300]}", no_wrap=True, overflow="ellipsis")


def timeline_text(doc: dict, token: dict, width: int = 16) -> Text:
    """The token's step: per layer, bars for router, experts and all-to-all time."""
    if "step" not in token:
        return Text("(no routing: the last generated token is never fed back)")
    step = doc["steps"][token["step"]]
    rows = [(layer, *(v or 0.0 for v in step["layer_s"].get(str(layer), [0, 0, 0])))
            for layer in doc["layers"]]
    total = max((r + e + a for _, r, e, a in rows), default=0.0) or 1.0
    out = Text(f"step {token['step']} ({step['phase']}, {step['seconds'] * 1e3:.2f} ms): router|experts|a2a\n")
    for layer, r, e, a in rows:
        bars = [(int(width * v / total), ch, style) for v, ch, style in
                ((r, "r", "cyan"), (e, "e", "green"), (a, "a", "magenta"))]
        out.append(f"L{layer:<3}")
        for n, ch, style in bars:
            out.append(ch * n, style=style)
        out.append(f" {_ms(r)}/{_ms(e)}/{_ms(a)} ms\n")
    return out


class TraceApp(App):
    AUTO_FOCUS = None  # the grid's keys are the app's: nothing may take them (the hidden search box would)
    ENABLE_COMMAND_PALETTE = False  # its footer hint would push "q quit" past 80 columns
    CSS = """
    #header { height: 4; }
    #spark { height: 1; }
    #legend { height: 1; }
    #grid { height: 1fr; }
    #cell { height: 3; }
    #token { display: none; height: 1fr; }
    #token.visible { display: block; }
    #grid.hidden, #cell.hidden { display: none; }
    #layers { height: 1fr; }
    #timeline { height: auto; max-height: 6; }
    #search { dock: bottom; display: none; }
    #search.visible { display: block; }
    """
    BINDINGS = [
        Binding("n", "next_anomaly", "next anomaly"),
        Binding("p", "prev_anomaly", "prev anomaly"),
        Binding("slash", "search", "search"),
        Binding("enter", "toggle_token", "token"),
        Binding("escape", "grid", show=False),
        Binding("c", "copy_id", "copy id"),
        Binding("q", "quit", "quit"),
        Binding("up", "move(-1, 0)", show=False), Binding("down", "move(1, 0)", show=False),
        Binding("left", "move(0, -1)", show=False), Binding("right", "move(0, 1)", show=False),
        Binding("pageup", "page(-1)", show=False), Binding("pagedown", "page(1)", show=False),
        Binding("home", "move(-1000000, 0)", show=False), Binding("end", "move(1000000, 0)", show=False),
    ]

    def __init__(self, doc: dict) -> None:
        super().__init__()
        self.doc = doc
        self.tokens = doc["tokens"]
        self.title = f"moescope trace {sanitize(doc['request_id'])}"
        self.row = 0  # selected token
        self.col = 0  # selected layer (index into doc["layers"])
        self.first_row = self.first_col = 0
        self.scale = trace_grid.entropy_scale(doc)

    def compose(self) -> ComposeResult:
        yield Static(header_text(self.doc), id="header")
        lat = [tok["latency_s"] for tok in self.tokens if tok["latency_s"] is not None]
        yield Sparkline(lat or [0.0], id="spark")
        yield Static(trace_grid.legend(self.doc), id="legend")
        yield Static(id="grid")
        yield Static(id="cell")
        with Vertical(id="token"):
            yield DataTable(id="layers", cursor_type="row")
            yield Static(id="timeline")
        yield Input(placeholder="search token text, Enter to find the next match", id="search")
        yield Footer()

    def on_mount(self) -> None:
        layers = self.query_one("#layers", DataTable)
        layers.add_columns("layer", "experts", "weights", "H", "margin", "cache", "exp ms", "a2a ms", "rank")
        self.call_after_refresh(self.redraw)

    def on_resize(self, event) -> None:
        self.redraw()

    # -- drawing -------------------------------------------------------------------------------------------
    @property
    def current(self) -> int:
        return self.row

    def _room(self) -> tuple[int, int]:
        """(token rows, layer columns) the grid has room for."""
        grid = self.query_one("#grid", Static)
        rows = max(1, (grid.size.height or 12) - 1)  # the layer ruler takes a line
        cols = max(1, (grid.size.width or self.size.width or 80) - trace_grid.LABEL)
        return rows, cols

    def redraw(self) -> None:
        rows, cols = self._room()
        self.first_row = min(max(self.first_row, self.row - rows + 1), self.row)
        self.first_col = min(max(self.first_col, self.col - cols + 1), self.col)
        self.query_one("#grid", Static).update(trace_grid.grid(self.doc, self.row, self.col, self.first_row, rows,
                                                               self.first_col, cols, self.scale))
        self.query_one("#cell", Static).update(trace_grid.details(self.doc, self.row, self.col))

    def show_token(self, index: int) -> None:
        """Fill the token view: every layer of token ``index`` and its step's timeline."""
        tok = self.tokens[index]
        layers = self.query_one("#layers", DataTable)
        layers.clear()
        for la in tok["layers"]:
            _, experts_s, a2a_s = trace_grid.layer_times(self.doc, tok, la["layer"])
            layers.add_row(str(la["layer"]), ",".join(map(str, la["experts"])),
                           ",".join(f"{w:.2f}" for w in la["weights"]), f"{la['entropy']:.2f}",
                           f"{la['margin']:.2f}", "".join("M" if s in la["misses"] else "h"
                                                          for s in range(len(la["experts"]))),
                           _ms(experts_s), _ms(a2a_s), str(self.doc["rank"]))
        if tok["layers"]:
            layers.move_cursor(row=self.col)
        self.query_one("#timeline", Static).update(timeline_text(self.doc, tok))

    def move_to(self, index: int, col: int | None = None) -> None:
        self.row = max(0, min(len(self.tokens) - 1, index))
        if col is not None:
            self.col = max(0, min(len(self.doc["layers"]) - 1, col))
        if self.query_one("#token").has_class("visible"):
            self.show_token(self.row)
        self.redraw()

    # -- actions -----------------------------------------------------------------------------------------
    def action_move(self, drow: int, dcol: int) -> None:
        self.move_to(self.row + drow, self.col + dcol)

    def action_page(self, step: int) -> None:
        self.action_move(step * self._room()[0], 0)

    def action_toggle_token(self) -> None:
        token = self.query_one("#token")
        if token.has_class("visible"):
            self.action_grid()
            return
        self.show_token(self.row)
        token.add_class("visible")
        for wid in ("#grid", "#cell"):
            self.query_one(wid).add_class("hidden")
        self.query_one("#layers", DataTable).focus()

    def action_grid(self) -> None:
        table = self.query_one("#layers", DataTable)
        if self.query_one("#token").has_class("visible") and self.tokens[self.row]["layers"]:
            self.col = table.cursor_row  # the layer picked in the table stays selected
        self.query_one("#token").remove_class("visible")
        for wid in ("#grid", "#cell"):
            self.query_one(wid).remove_class("hidden")
        self.set_focus(None)
        self.redraw()

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        self.action_grid()  # Enter in the token's table: back to the grid at that layer

    def _anomaly(self, step: int) -> None:
        n = len(self.tokens)
        for off in range(1, n + 1):
            i = (self.current + step * off) % n
            if self.tokens[i]["flags"]:
                self.move_to(i)
                return
        self.notify("no anomalous token in this request")

    def action_next_anomaly(self) -> None:
        self._anomaly(1)

    def action_prev_anomaly(self) -> None:
        self._anomaly(-1)

    def action_search(self) -> None:
        box = self.query_one("#search", Input)
        box.add_class("visible")
        box.focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        needle = event.value
        box = self.query_one("#search", Input)
        box.remove_class("visible")
        self.set_focus(None)
        if not needle:
            return
        texts = [sanitize(t["text"]) if len(t["text"]) == 1 else t["text"] for t in self.tokens]
        joined, starts = "", []
        for t in texts:
            starts.append(len(joined))
            joined += t
        pos = joined.find(needle, starts[self.current] + 1 if self.current < len(starts) else 0)
        if pos < 0:
            pos = joined.find(needle)
        if pos < 0:
            self.notify(f"no token text matches {sanitize(needle)!r}")
            return
        self.move_to(max(i for i, s in enumerate(starts) if s <= pos))

    def action_copy_id(self) -> None:
        self.copy_to_clipboard(self.doc["request_id"])
        self.notify(f"copied {sanitize(self.doc['request_id'])}")
