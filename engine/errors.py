"""The one exception type the engine raises for bad input."""


class EngineError(ValueError):
    """Bad input or an impossible request. The message is meant for the user; the pool is left unchanged."""
