"""The ``moescope`` command line. One module per subcommand; ``main(argv) -> int`` never lets a user error
escape as a traceback: usage errors and ``MoescopeError`` become one line on stderr and their exit code."""

from __future__ import annotations

import sys

import click

from moescope.errors import MoescopeError


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="moescope", prog_name="moescope")
def cli() -> None:
    """moescope: observability and diagnostics for Mixture-of-Experts inference."""


def _register() -> None:
    from moescope.cli import (alerts_cmd, baseline_cmd, cache_sim, check_cmd, dashboards_cmd, demo, diagnose_cmd,
                              plan_cmd, report_cmd, requests_cmd, serve_cmd, top_cmd, trace_cmd,
                              train_demo)

    cli.add_command(alerts_cmd.alerts)
    cli.add_command(baseline_cmd.baseline)
    cli.add_command(dashboards_cmd.dashboards)
    cli.add_command(cache_sim.cache_sim)
    cli.add_command(check_cmd.check)
    cli.add_command(requests_cmd.requests_cmd)
    cli.add_command(trace_cmd.trace_cmd)
    cli.add_command(demo.demo)
    cli.add_command(diagnose_cmd.diagnose_cmd)
    cli.add_command(plan_cmd.plan_cmd)
    cli.add_command(report_cmd.report_cmd)
    cli.add_command(top_cmd.top_cmd)
    cli.add_command(train_demo.train_demo)
    cli.add_command(serve_cmd.serve)


_register()


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
        return exc.exit_code
    except click.exceptions.Abort:
        click.echo("moescope: aborted", err=True)
        return 130
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except BrokenPipeError:
        return 0
    return rv if isinstance(rv, int) else 0


def entry() -> None:
    sys.exit(main())
