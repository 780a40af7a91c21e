"""The exceptions exactscore raises."""

import builtins
from typing import Any, Dict, Optional


class ExactScoreError(Exception):
    """Base class of every error exactscore raises."""


class ServerError(ExactScoreError):
    """The server answered with an error status, or with a response the client cannot use.

    ``status`` is the HTTP status (e.g. 422 for a request the server refused, 401 for a wrong
    API key, 503 after the retries ran out); ``body`` is the server's JSON error
    ``{"error", "kind", "field", "rule", "value"}`` (None when it sent none), and ``message``,
    ``kind``, ``field``, ``rule`` and ``value`` are its entries; ``url`` is the route asked.
    """

    def __init__(
        self,
        text: str,
        status: int,
        body: Optional[Dict[str, Any]] = None,
        url: Optional[str] = None,
    ) -> None:
        super().__init__(text)
        self.status = status
        self.body = body
        self.url = url

    def _entry(self, key: str) -> Any:
        return None if self.body is None else self.body.get(key)

    @property
    def message(self) -> Optional[str]:
        """The server's error message (``body["error"]``)."""
        return self._entry("error")

    @property
    def kind(self) -> Optional[str]:
        """The kind of error, e.g. ``"validation_error"``."""
        return self._entry("kind")

    @property
    def field(self) -> Optional[str]:
        """The request field the error is about, if any."""
        return self._entry("field")

    @property
    def rule(self) -> Optional[str]:
        """The rule the field broke, if any."""
        return self._entry("rule")

    @property
    def value(self) -> Any:
        """The offending value, if the server named it."""
        return self._entry("value")


class ConnectionError(ExactScoreError, builtins.ConnectionError):
    """No usable answer: the server could not be reached or the connection broke (after the
    retries), or a request timed out. ``url`` is the route asked."""

    def __init__(self, text: str, url: Optional[str] = None) -> None:
        super().__init__(text)
        self.url = url


class ValidationError(ExactScoreError, ValueError):
    """Refused before any request was sent: an argument, a dataset or a partial file."""
