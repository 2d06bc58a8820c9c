"""``moescope demo`` at a terminal: the workload runs on a thread while the live view (``moescope top`` on
this run's own exporter) fills the screen; the summary prints when the view closes.

The view is ``TopApp`` as it is; this adds only the run's lifetime: the app starts the engine when it mounts
and closes when the workload ends; quitting the view early (q) stops the engine after its current step
(``Engine.request_stop``), and the summary covers what was served. ``--no-tui`` (or ``--json``, or output
that is not a terminal) keeps plain output.
"""

from __future__ import annotations

import threading


def serve_with_live_view(engine, requests, run: dict, metrics_url: str, interval_s: float = 1.0) -> list:
    """Serve ``requests`` (``engine.run(requests, **run)``) under the live view; returns the finished records.
    An error on the engine thread is raised here, after the view has closed."""
    # optional: rich, textual (tui.top_app; the tui extra)
    from moescope.tui.top_app import TopApp
    from moescope.tui.top_data import Poller

    outcome: dict = {}

    class LiveRun(TopApp):
        def on_mount(self) -> None:
            super().on_mount()
            self.sub_title = "moescope demo: q stops the run and prints its summary"
            threading.Thread(target=self._serve, name="moescope-demo-engine", daemon=True).start()

        def _serve(self) -> None:
            try:
                outcome["records"] = engine.run(requests, **run)
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread, raised there
                outcome["error"] = exc
            finally:
                outcome["done"] = True
                try:
                    self.call_from_thread(self.exit)
                except RuntimeError:  # the view already closed (q): nothing to tell it
                    pass

    app = LiveRun(Poller([metrics_url]), min(1.0, max(0.2, interval_s)))
    app.run()
    if not outcome.get("done"):  # the person quit the view: end the run at the next step, keep what it served
        engine.request_stop()
    while not outcome.get("done"):
        threading.Event().wait(0.05)
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("records", engine.finished)
