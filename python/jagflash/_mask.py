"""(causal, window) as the user gives them -> (jf_mask, window_left, window_right) for the C API."""
from . import _capi
from ._errors import invalid_argument


def mask_args(causal, window):
    """FlashAttention's convention: window (left, right), -1 unbounded; causal is (-1, 0), and a
    causal call may narrow the left side (a causal sliding window)."""
    try:
        left, right = (int(w) for w in window)
    except (TypeError, ValueError):
        raise invalid_argument("window", "a pair (left, right) of ints, -1 = unbounded", repr(window)) from None
    for name, w in (("window[0]", left), ("window[1]", right)):
        if w < -1:
            raise invalid_argument(name, ">= -1 (-1 = unbounded)", w)
    if causal:
        if right not in (-1, 0):
            raise invalid_argument("window[1]", "-1 or 0 with causal=True (causal sees no key to the right)", right)
        return (_capi.MASK_CAUSAL, -1, -1) if left == -1 else (_capi.MASK_WINDOW, left, 0)
    if (left, right) == (-1, -1):
        return _capi.MASK_NONE, -1, -1
    return _capi.MASK_WINDOW, left, right
