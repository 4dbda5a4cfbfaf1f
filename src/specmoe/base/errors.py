"""What a user can fix, in one line: the error types and the warning line.

`SpecMoEError`: bad input (a flag, a file, a request); the CLI prints its message on
stderr and exits with status 2. `EnvironmentFailure`: the machine said no (a disk that is
full or read-only, a path through a regular file, a read that failed); exit status 1.
Both messages name the path or the value and what to do, without a traceback.
"""

from __future__ import annotations

import os
import sys


class SpecMoEError(ValueError):
    """A problem with the user's input or setup, with the fix in the message."""

    exit_status = 2


class EnvironmentFailure(SpecMoEError):
    """The file system or a device failed where the input was fine; the fix in the message."""

    exit_status = 1


def os_failure(exc: OSError, doing: str, fix: str) -> EnvironmentFailure:
    """`cannot write /x/experts.bin: no space left on device; <fix>` from an OSError.

    `doing` names the action and the path ("cannot write the expert file /x/e.bin")."""
    reason = (exc.strerror or str(exc)).lower()
    filename = str(exc.filename or "")
    # name the file the error is about unless `doing` names it or its directory already
    named = not filename or any(p and p in doing for p in (filename, os.path.dirname(filename)))
    where = "" if named else f" ({filename})"
    return EnvironmentFailure(f"{doing}: {reason}{where}; {fix}")


def warn(message: str) -> None:
    """One line on stderr for something specmoe handled itself (and the user may want to know)."""
    print(f"specmoe: warning: {message}", file=sys.stderr, flush=True)
