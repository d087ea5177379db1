"""The exception and the warning users see."""


class TPCompileError(ValueError):
    """A user-facing failure: the message names the module, op or value and the way out."""


class TPCompileWarning(UserWarning):
    """A part of the model is replicated instead of split; numerics are unaffected."""
