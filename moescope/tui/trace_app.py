"""`moescope trace` as a Textual app: a thin view over one request's trace document (``store.load_request``).

Layout (fits 80x24): request header, a latency sparkline, the token list (left) and, for the selected
token, its layer-by-layer routing table and a timeline of its step (right). Keys in the footer:
n / p next / previous anomaly, / search token text, c copy the request id, q quit. All text shown passes
through ``sanitize`` and is rendered as ``rich.text.Text`` (never parsed as markup).
"""

from __future__ import annotations

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import DataTable, Footer, Input, Sparkline, Static

from moescope.traces.sanitize import sanitize


def _ms(x) -> str:
    return f"{x * 1e3:.2f}" if isinstance(x, (int, float)) else "-"


def header_text(doc: dict) -> Text:
    t = doc["timings"]
    flags = ",".join(doc["flags"]) or "-"
    return Text(
        f"{sanitize(doc['request_id'])}  {doc['model']}  rank {doc['rank']}  {doc['domain']}/{doc['tenant']}  "
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
    CSS = """
    #header { height: 4; }
    #spark { height: 2; }
    #tokens { width: 34; }
    #layers { height: 1fr; }
    #timeline { height: auto; max-height: 8; }
    #search { dock: bottom; display: none; }
    #search.visible { display: block; }
    """
    BINDINGS = [
        Binding("n", "next_anomaly", "next anomaly"),
        Binding("p", "prev_anomaly", "prev anomaly"),
        Binding("slash", "search", "search"),
        Binding("c", "copy_id", "copy id"),
        Binding("q", "quit", "quit"),
    ]

    def __init__(self, doc: dict) -> None:
        super().__init__()
        self.doc = doc
        self.tokens = doc["tokens"]
        self.title = f"moescope trace {sanitize(doc['request_id'])}"

    def compose(self) -> ComposeResult:
        yield Static(header_text(self.doc), id="header")
        lat = [tok["latency_s"] for tok in self.tokens if tok["latency_s"] is not None]
        yield Sparkline(lat or [0.0], id="spark")
        with Horizontal():
            yield DataTable(id="tokens", cursor_type="row", zebra_stripes=True)
            with Vertical():
                yield DataTable(id="layers", cursor_type="row")
                yield Static(id="timeline")
        yield Input(placeholder="search token text, Enter to find the next match", id="search")
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one("#tokens", DataTable)
        table.add_columns("#", "ph", "text", "ms", "flags")
        for tok in self.tokens:
            table.add_row(str(tok["index"]), tok["phase"][:3], Text(sanitize(tok["text"], keep_newlines=False)),
                          _ms(tok["latency_s"]), ",".join(tok["flags"]), key=str(tok["index"]))
        layers = self.query_one("#layers", DataTable)
        layers.add_columns("layer", "experts", "weights", "H", "margin", "cache", "exp ms", "a2a ms", "rank")
        table.focus()
        self.show_token(0)

    # -- selection ---------------------------------------------------------------------------------------
    @property
    def current(self) -> int:
        return self.query_one("#tokens", DataTable).cursor_row

    def show_token(self, index: int) -> None:
        tok = self.tokens[index]
        layers = self.query_one("#layers", DataTable)
        layers.clear()
        for la in tok["layers"]:
            layers.add_row(str(la["layer"]), ",".join(map(str, la["experts"])),
                           ",".join(f"{w:.2f}" for w in la["weights"]), f"{la['entropy']:.2f}",
                           f"{la['margin']:.2f}", "".join("M" if c == "miss" else "h" for c in la["cache"]),
                           _ms(la["expert_s"]), _ms(la["all_to_all_s"]), str(la["rank"]))
        self.query_one("#timeline", Static).update(timeline_text(self.doc, tok))

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        if event.data_table.id == "tokens":
            self.show_token(event.cursor_row)

    def move_to(self, index: int) -> None:
        self.query_one("#tokens", DataTable).move_cursor(row=index)
        self.show_token(index)

    # -- actions -----------------------------------------------------------------------------------------
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
        self.query_one("#tokens", DataTable).focus()
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
