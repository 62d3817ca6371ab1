"""Errors a retry cannot fix end the activity for good, so the run fails with the message instead of
retrying the same input forever. One mapping, used by every activity module."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from temporalio.exceptions import ApplicationError

from laminar.errors import ConfigError, CorruptDataError, InconsistentStateError, LaminarError

# error class -> ApplicationError type (what operators and the workflow see)
_TYPES: dict[type[LaminarError], str] = {
    ConfigError: "ConfigError",
    InconsistentStateError: "InconsistentState",
    CorruptDataError: "CorruptData",
}


@contextmanager
def permanent_errors(*extra: type[LaminarError]) -> Iterator[None]:
    """ConfigError and InconsistentStateError (plus the `extra` classes this activity cannot recover
    from, e.g. CorruptDataError for the trainer) become non-retryable ApplicationErrors."""
    permanent = (ConfigError, InconsistentStateError, *extra)
    try:
        yield
    except permanent as e:
        kind = next((name for cls, name in _TYPES.items() if isinstance(e, cls)), type(e).__name__)
        raise ApplicationError(str(e), type=kind, non_retryable=True) from e
