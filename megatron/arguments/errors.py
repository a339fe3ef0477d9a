"""`ArgumentError`: the one exception for bad flags, shared by the validation and the ds_config."""


class ArgumentError(ValueError):
    """Flags that contradict each other or the world size (message names them)."""
