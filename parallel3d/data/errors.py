"""The one exception type of the data pipeline."""


class DataError(ValueError):
    """Bad data input: the message names the file/key/value and what is allowed."""
