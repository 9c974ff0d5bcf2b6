"""How a multi-rank job reports a failed rank (torch-free, so that any command can catch it)."""


class RankFailed(RuntimeError):
    """A rank of a spawned job raised or died; the message holds its traceback."""
