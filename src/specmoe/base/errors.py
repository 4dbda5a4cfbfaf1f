"""One exception type for everything a user can fix.

Its message is one line that names what is wrong and what to change; the CLI prints
it on stderr and exits with status 2, without a traceback.
"""


class SpecMoEError(ValueError):
    """A problem with the user's input or setup, with the fix in the message."""
