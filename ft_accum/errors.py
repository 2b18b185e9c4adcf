"""The one error type the recipes turn into a one-line message instead of a traceback."""


class ConfigError(ValueError):
    """A setting or an input is wrong. The message names the problem and the fix."""
