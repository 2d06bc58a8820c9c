"""``moescope dashboards build|push``: generate the Grafana dashboards, upload them with grafana-client."""

from __future__ import annotations

import json
from pathlib import Path

import click

from moescope.errors import BadInput


@click.group("dashboards")
def dashboards() -> None:
    """Grafana dashboards as code (dashboards/*.json)."""


@dashboards.command("build")
@click.option("--root", type=click.Path(file_okay=False, path_type=Path), default=Path("."), show_default=True)
def build(root: Path) -> int:
    """Regenerate dashboards/*.json and the provisioning YAML."""
    # start-up: numpy (dashboards.grafana), only when the command runs, not for --help
    from moescope.dashboards import grafana as builder

    for path in builder.write(root):
        click.echo(f"wrote {path}")
    return 0


@dashboards.command("push")
@click.option("--url", required=True, help="Grafana base URL, e.g. http://127.0.0.1:3000")
@click.option("--token", envvar="GRAFANA_TOKEN", required=True, help="Service-account token ($GRAFANA_TOKEN).")
@click.option("--dir", "directory", type=click.Path(file_okay=False, path_type=Path), default=Path("dashboards"),
              show_default=True)
def push(url: str, token: str, directory: Path) -> int:
    """Upload every dashboards/*.json to Grafana (overwriting the same uid)."""
    try:
        from grafana_client import GrafanaApi  # optional: grafana_client (the dashboards extra)
    except ImportError:
        raise BadInput("`moescope dashboards push` needs grafana-client: pip install 'moescope[dashboards]'") from None
    files = sorted(directory.glob("*.json"))
    if not files:
        raise BadInput(f"no dashboards in {directory} (run `moescope dashboards build`)")
    api = GrafanaApi.from_url(url=url, credential=token, timeout=10)
    for path in files:
        doc = json.loads(path.read_text())
        try:
            api.dashboard.update_dashboard({"dashboard": doc, "overwrite": True})
        except Exception as exc:  # connection refused, DNS, 401/403/5xx: one clear line
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            raise BadInput(f"cannot push {path.name} to Grafana at {url}: {first}") from None
        click.echo(f"pushed {path.name}")
    return 0
