"""The package version: pyproject.toml's, read from the installed distribution (written once, there)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("moescope")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"
