"""The replay's one error type."""

from __future__ import annotations

from ...base.errors import SpecMoEError


class ReplayError(SpecMoEError):
    """Bad input to `specmoe replay`: one line, exit code 2."""
