"""The console's errors: a stable code, an HTTP status and a sentence, never a traceback.

Every error the console answers is a :class:`Problem`. The API answers it as
``{"error": {"code": ..., "message": ...}}``; a page renders it. Anything
unexpected becomes ``internal`` (500) with no detail: the traceback goes to
the log, never to the client, since it can hold settings.
"""

from __future__ import annotations

from kdelay.errors import KdelayError


class Problem(KdelayError):
    """An error the console answers with ``status`` and a stable ``code``."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message

    def body(self) -> dict[str, dict[str, str]]:
        """The JSON body the API answers."""
        return {"error": {"code": self.code, "message": self.message}}


def bad_input(code: str, message: str) -> Problem:
    """A request the client must change (400)."""
    return Problem(400, code, message)


UNAUTHENTICATED = "unauthenticated"
FORBIDDEN = "forbidden"
CSRF_FAILED = "csrf-failed"
INTERNAL = "internal"
