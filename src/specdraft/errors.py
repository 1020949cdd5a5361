"""User-facing errors: the CLI prints them as one line, the server as a 4xx JSON body."""


class SpecdraftError(Exception):
    """A problem with the user's input or files (not a bug): shown without a traceback."""


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (its type's name if the message is empty):
    enough to say why in a one-line error, without another library's multi-line detail."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
