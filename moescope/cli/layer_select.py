"""``--layers SPEC``: which MoE layers a command shows (``trace``, ``report``): ``all`` or layer ids and ranges
such as ``3,17,40-45``. Parsed once, here; whether the layers exist is for the reader of the data to say."""

from __future__ import annotations

import click

from moescope.errors import BadInput

ALL = "all"


def parse(spec: str | None) -> list[int] | str | None:
    """None (nothing asked), ``ALL``, or the sorted layer ids of ``spec``."""
    if spec is None or not spec.strip():
        return None
    if spec.strip() == ALL:
        return ALL
    out: set[int] = set()
    try:
        for part in spec.split(","):
            lo, _, hi = part.strip().partition("-")
            first, last = int(lo), int(hi or lo)
            if first > last:
                raise ValueError
            out.update(range(first, last + 1))
    except ValueError:
        raise BadInput(f"--layers {spec!r}: use 'all' or layer ids and ranges such as 3,17,40-45") from None
    return sorted(out)


def _callback(ctx, param, value):
    return parse(value)


def layers_option(help: str):
    return click.option("--layers", "layers", callback=_callback, default=None, metavar="SPEC", help=help)
