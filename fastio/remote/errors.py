"""The errors about one remote object, each naming its URL without credentials (:func:`redact`).
:mod:`fastio.remote.fetch` raises them (and re-exports them) as its docstring describes.

Example::

    err = RemoteReadError("https://bob:pw@host/a.bin", 6, "HTTP 503")
    assert err.url == "https://***@host/a.bin" and err.attempts == 6
"""

from __future__ import annotations

import re

__all__ = ["RemoteAccessError", "RemoteError", "RemoteNotFoundError", "RemoteReadError", "redact"]

_USERINFO = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s]*@")
_QUERY_VALUE = re.compile(r"([?&][^=&#\s]+=)[^&#\s]*")


def redact(text: str) -> str:
    """``text`` with credentials removed from every URL in it: ``user:password@`` and query values (a
    presigned URL's signature) become ``***``.

    Example::

        assert redact("https://bob:pw@host/a.bin?sig=abc") == "https://***@host/a.bin?sig=***"
    """
    text = _USERINFO.sub(r"\1***@", str(text))
    return _QUERY_VALUE.sub(r"\1***", text)


class RemoteError(OSError):
    """Base of the errors about one remote object; ``url`` is redacted (no credentials)."""

    def __init__(self, url: str, message: str) -> None:
        self.url = redact(url)
        super().__init__(f"{self.url}: {message}")

    def __reduce__(self) -> tuple:  # rebuilt from its text when it crosses from a worker process
        return (_rebuild, (type(self), self.url, str(self)))


def _rebuild(cls: type, url: str, text: str) -> RemoteError:
    err = cls.__new__(cls)
    OSError.__init__(err, text)
    err.url = url
    return err


class RemoteNotFoundError(RemoteError, FileNotFoundError):
    """The object does not exist (HTTP 404/410, S3 NoSuchKey): raised at once, never retried.

    Example::

        try:
            remote_size("http://127.0.0.1:8000/missing.bin", RetryPolicy())
        except RemoteNotFoundError as err:
            print(err.url, err.code)
    """

    def __init__(self, url: str, code: str) -> None:
        self.code = code
        super().__init__(url, f"not found ({code})")


class RemoteAccessError(RemoteError, PermissionError):
    """Access denied (HTTP 401/403, S3 AccessDenied): raised at once, never retried.

    Example::

        err = RemoteAccessError("s3://bucket/a.bin", "403")
        assert "403" in str(err)
    """

    def __init__(self, url: str, code: str) -> None:
        self.code = code
        super().__init__(
            url, f"access denied ({code}); credentials come from the environment or storage_options"
        )


class RemoteReadError(RemoteError):
    """Reading the object failed: transient failures beyond the retry budget, or an unexpected error.

    Example::

        err = RemoteReadError("http://h/a.bin", 6, "HTTP 503")
        assert err.attempts == 6 and "503" in str(err)
    """

    def __init__(self, url: str, attempts: int, cause: str) -> None:
        self.attempts, self.cause = attempts, cause
        super().__init__(url, f"read failed after {attempts} attempt(s); last cause: {cause}")
