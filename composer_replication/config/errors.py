"""`ConfigError`: a configuration problem the user must fix (the CLI exits with code 2).

Its own module, importable without the schema (which imports the loss library and torch), so
the command line can catch it while staying cheap to start.
"""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A configuration problem the user must fix (the CLI exits with code 2)."""
