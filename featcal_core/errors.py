"""The one exception type the library raises for bad input.

Every message names the offending file, key or argument and says how to fix it; the CLI prints it
as a single line and exits non-zero.
"""


class FeatCalError(Exception):
    """Bad input or an unrecoverable condition that the user can fix (file, key, argument)."""
