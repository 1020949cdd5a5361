"""User-facing errors: the CLI prints them as one line, the server as a 4xx JSON body."""


class SpecdraftError(Exception):
    """A problem with the user's input or files (not a bug): shown without a traceback."""
