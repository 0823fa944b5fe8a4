"""Errors: the C API's status and message become Python exceptions carrying the same message."""
import ctypes
import re
from typing import Sequence, Tuple, Union

from . import _capi


class JagflashError(RuntimeError):
    """A jagflash call failed; `status` is the C API's jf_status (0 for checks done in Python)."""

    def __init__(self, message: str, status: int = _capi.ERR_INTERNAL) -> None:
        super().__init__(message)
        self.status = status


class InvalidArgumentError(JagflashError, ValueError):
    """JF_ERR_INVALID_ARGUMENT: an argument's shape, stride, dtype, offsets or mask is wrong."""


class UnsupportedError(JagflashError, NotImplementedError):
    """JF_ERR_UNSUPPORTED: a valid request this build cannot serve (head dim, dtype, backend)."""


_BY_STATUS = {
    _capi.ERR_INVALID_ARGUMENT: InvalidArgumentError,
    _capi.ERR_UNSUPPORTED: UnsupportedError,
}


def invalid_argument(argument: str, expected: str, given: object) -> InvalidArgumentError:
    """The C API's message shape, for the few checks that must happen before a C call."""
    return InvalidArgumentError(f"{argument}: expected {expected}, got {given}", _capi.ERR_INVALID_ARGUMENT)


def unsupported(argument: str, expected: str, given: object) -> UnsupportedError:
    """invalid_argument's message shape for a valid value that this entry point cannot serve."""
    return UnsupportedError(f"{argument}: expected {expected}, got {given}", _capi.ERR_UNSUPPORTED)


def reworded(error: JagflashError, substitutions: Sequence[Tuple[Union[str, "re.Pattern[str]"], str]]) -> JagflashError:
    """error with its message in another caller's terms: each (pattern, replacement) applied in
    turn (re.sub). The same class and status; error itself when nothing changed."""
    message = str(error)
    for pattern, replacement in substitutions:
        message = re.sub(pattern, replacement, message)
    if message == str(error):
        return error
    return type(error)(message, error.status)


def check(status: int, lib: ctypes.CDLL) -> None:
    """Raises the exception that matches a non-OK status, with jagflash_last_error()'s message."""
    if status == _capi.OK:
        return
    message = lib.jagflash_last_error().decode("utf-8", errors="replace")
    raise _BY_STATUS.get(status, JagflashError)(message, status)
