"""The one exception type users see."""


class TPCompileError(ValueError):
    """A user-facing failure: the message names the module, op or value and the way out."""
