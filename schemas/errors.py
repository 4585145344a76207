"""The one error every decode or validation failure becomes (its message is the dead-letter reason)."""

from __future__ import annotations

from pydantic import ValidationError

MAX_REASON_CHARS = 300


class DecodeError(Exception):
    """Raised for every failure to decode or validate bytes from the wire; str() is a short reason."""

    def __init__(self, reason: str) -> None:
        """Keep the reason short: it becomes the `reason` field of a dead-letter entry."""
        if len(reason) > MAX_REASON_CHARS:
            reason = reason[: MAX_REASON_CHARS - 3] + "..."
        super().__init__(reason)
        self.reason = reason


def _pydantic_reason(exc: ValidationError) -> str:
    """Short reason from a pydantic error: field location and message of the first few errors."""
    parts = []
    for err in exc.errors()[:3]:
        loc = ".".join(str(p) for p in err["loc"])
        parts.append(f"{loc}: {err['msg']}" if loc else str(err["msg"]))
    more = f" (+{exc.error_count() - 3} more)" if exc.error_count() > 3 else ""
    return f"invalid {exc.title}: " + "; ".join(parts) + more


def as_decode_error(exc: Exception) -> DecodeError:
    """Map any exception raised while decoding to a DecodeError with a concise reason."""
    if isinstance(exc, DecodeError):
        return exc
    if isinstance(exc, ValidationError):
        return DecodeError(_pydantic_reason(exc))
    if isinstance(exc, RecursionError):
        return DecodeError("payload nested too deeply")
    if type(exc).__module__.startswith("msgpack"):
        return DecodeError(
            f"bad msgpack ({type(exc).__name__}): {exc}"
            if str(exc)
            else f"bad msgpack ({type(exc).__name__})"
        )
    message = str(exc)
    if type(exc) is ValueError and message:
        return DecodeError(message)
    return DecodeError(f"{type(exc).__name__}: {message}" if message else type(exc).__name__)
