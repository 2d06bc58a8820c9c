"""Errors that carry a CLI exit code.

The CLI turns a ``MoescopeError`` into one line on stderr and its exit code; anything else is a bug and
keeps its traceback. Exit codes follow DESIGN.md: 0 ok, 1 a check found a problem, 2 bad input.
"""

from __future__ import annotations


class MoescopeError(Exception):
    """Base class: a message fit for one line of output, and the exit code it maps to."""

    exit_code = 2


class BadInput(MoescopeError, ValueError):
    """The user gave us something we cannot use: a bad flag value, config, file or request id."""

    exit_code = 2


class ConfigError(BadInput):
    """A model/runtime configuration that violates a constraint (k > experts, sizes <= 0, ...)."""


class CheckFailed(MoescopeError):
    """A check ran to completion and found a problem (exit 1)."""

    exit_code = 1
