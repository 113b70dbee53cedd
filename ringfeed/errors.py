"""The one error type users see as a single line: `ringfeed: error: <what> (<what to do>)`."""

from __future__ import annotations


class UserError(Exception):
    """Bad input (config, path, data) the user can fix. The CLI prints it on one line and exits
    with `exit_code` (2 by default), without a traceback."""

    exit_code = 2
    label = "error"  # the CLI prints `ringfeed: <label>: <message>`

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code
