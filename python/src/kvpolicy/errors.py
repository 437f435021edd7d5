"""kvpolicy.Error: the one exception a rejected input raises."""


class Error(ValueError):
    """An input kvpolicy rejected, raised before any byte of the cache is written.

    ``field`` names the offending argument as a path into it, as the C++ library's
    ``kvp::error`` does: ``"batch[2].budget"``, ``"cache.lengths[5]"``, ``"scores"``,
    ``"kv[3]"``. The message repeats the field and gives the value.
    """

    def __init__(self, message: str, field: str = ""):
        super().__init__(message)
        self.field = field

    def __reduce__(self):  # pickles with its field (multiprocessing, pytest-xdist)
        return (type(self), (str(self), self.field))
