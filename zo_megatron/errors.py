"""User-facing errors: one line that names the problem and the fix.

The CLI catches `UserError` and prints `error: <message>` with exit code 2, never a traceback.
"""


class UserError(ValueError):
    """Bad input from the user (flags, files, environment)."""


class ConfigError(UserError):
    """An impossible parallel/model/batch configuration."""
