"""(causal, window) as the user gives them -> (jf_mask, window_left, window_right) for the C API."""
import operator
from typing import Any, Tuple

from . import _capi
from ._errors import invalid_argument

# jf_problem's window fields are int32: ctypes would wrap a larger value without a word.
_INT32_LIMIT = 2**31


def window_side(name: str, w: Any) -> int:
    """One side of the window as an exact int: 1.9 is refused rather than truncated to 1, and a
    bool (an int to Python) is refused as the mistake it almost always is."""
    if isinstance(w, bool):
        raise invalid_argument(name, "an int (-1 = unbounded)", repr(w))
    try:
        value = operator.index(w)
    except TypeError:
        raise invalid_argument(name, "an int (-1 = unbounded)", repr(w)) from None
    if not -1 <= value < _INT32_LIMIT:
        raise invalid_argument(name, ">= -1 (-1 = unbounded) and < 2^31", value)
    return value


def mask_args(causal: Any, window: Any) -> Tuple[int, int, int]:
    """FlashAttention's convention: window (left, right), -1 unbounded; causal is (-1, 0), and a
    causal call may narrow the left side (a causal sliding window)."""
    # Only a bool: any other value would count by its truth, so causal="no" would be causal.
    if not isinstance(causal, bool):
        raise invalid_argument("causal", "True or False", repr(causal))
    try:
        left, right = window
    except (TypeError, ValueError):
        raise invalid_argument("window", "a pair (left, right) of ints, -1 = unbounded", repr(window)) from None
    left, right = window_side("window[0]", left), window_side("window[1]", right)
    if causal:
        if right not in (-1, 0):
            raise invalid_argument("window[1]", "-1 or 0 with causal=True (causal sees no key to the right)", right)
        return (_capi.MASK_CAUSAL, -1, -1) if left == -1 else (_capi.MASK_WINDOW, left, 0)
    if (left, right) == (-1, -1):
        return _capi.MASK_NONE, -1, -1
    return _capi.MASK_WINDOW, left, right
