"""The one exception type for user mistakes.

A `BigfitError` is shown as a short message with no traceback and makes the command exit with
status 2. Anything else that escapes is a bug or a machine fault and keeps its traceback.
"""


class BigfitError(Exception):
    """A mistake in what the user asked for: bad flag value, missing file, bad checkpoint path."""


def one_of(name: str, value, valid) -> BigfitError:
    """An error naming the bad value and every valid one."""
    return BigfitError(f"{name} {value!r} is not valid; choose one of: {', '.join(map(str, valid))}")
