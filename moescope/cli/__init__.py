"""The ``moescope`` command line. One module per subcommand; ``main(argv) -> int`` never lets a user error
escape as a traceback: usage errors and ``MoescopeError`` become one line on stderr and their exit code."""

from __future__ import annotations

import importlib
import json
import os
import sys
import time

import click

from moescope.errors import MoescopeError


# Subcommand -> "module:attribute". A command's module is imported when the command runs (or for --help):
# `moescope trace ID` should not pay for the imports of demo, serve and report (half its start-up otherwise).
COMMANDS = {
    "alerts": "alerts_cmd:alerts", "baseline": "baseline_cmd:baseline", "cache-sim": "cache_sim_cmd:cache_sim",
    "capture": "capture_cmd:capture",
    "check": "check_cmd:check", "dashboards": "dashboards_cmd:dashboards", "demo": "demo:demo",
    "diagnose": "diagnose_cmd:diagnose_cmd", "plan-placement": "plan_cmd:plan_cmd", "report": "report_cmd:report_cmd",
    "requests": "requests_cmd:requests_cmd", "serve": "serve_cmd:serve", "top": "top_cmd:top_cmd",
    "trace": "trace_cmd:trace_cmd", "traces": "traces_cmd:traces", "train-demo": "train_demo:train_demo",
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*COMMANDS, *self.commands})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in self.commands and name in COMMANDS:
            module, attr = COMMANDS[name].split(":")
            self.add_command(getattr(importlib.import_module(f"moescope.cli.{module}"), attr), name)
        return self.commands.get(name)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="moescope", prog_name="moescope")
def cli() -> None:
    """moescope: observability and diagnostics for Mixture-of-Experts inference."""


def _one_line(message: str) -> str:
    return " ".join(message.split())


def main(argv: list[str] | None = None) -> int:
    try:
        rv = cli.main(args=argv, prog_name="moescope", standalone_mode=False)
    except click.UsageError as exc:
        hint = f" (see `{exc.ctx.command_path} --help`)" if exc.ctx is not None else ""
        click.echo(f"moescope: error: {_one_line(exc.format_message())}{hint}", err=True)
        return 2
    except click.ClickException as exc:
        click.echo(f"moescope: error: {_one_line(exc.format_message())}", err=True)
        return exc.exit_code
    except MoescopeError as exc:
        click.echo(f"moescope: error: {_one_line(str(exc))}", err=True)
        _error_file(f"moescope: error: {_one_line(str(exc))}")
        return exc.exit_code
    except click.exceptions.Abort:
        click.echo("moescope: aborted", err=True)
        return 130
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except BrokenPipeError:
        return 0
    return rv if isinstance(rv, int) else 0


def _error_file(line: str) -> None:
    """A rank under torchrun (``TORCHELASTIC_ERROR_FILE`` set) leaves its one-line error in its error file, where
    the launcher reads it (torch.distributed.elastic's per-rank error files)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        try:
            with open(path, "w") as f:
                json.dump({"message": {"message": line, "extraInfo": {"timestamp": str(int(time.time()))}}}, f)
        except OSError:
            pass


def entry() -> None:
    sys.exit(main())
