"""The benchmark batches and FLOP counts, from the C library so Python and C++ agree exactly."""
import ctypes
from typing import List, Tuple

from . import _capi, _errors, _lib
from ._mask import mask_args

# The five distributions of shared/bench/distributions.md, in the order its tables use.
DISTRIBUTIONS = ("uniform1k", "gemskew", "pareto", "onegiant", "short")
# jagflash::gen::kDefaultSeed: the seed of the C++ CLI and benchmarks.
DEFAULT_SEED = 20261129


def generate_lengths(name: str, seed: int = DEFAULT_SEED) -> List[int]:
    """Sequence lengths of the named distribution for this seed (the same batch jagflash's C++
    benchmarks draw). seed: an int in [0, 2^64) (ctypes would wrap a negative one, or one past
    uint64, without a word)."""
    if not isinstance(name, str):
        raise _errors.invalid_argument("name", f"one of {', '.join(DISTRIBUTIONS)}", repr(name))
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise _errors.invalid_argument("seed", "an int in [0, 2^64)", repr(seed))
    lib = _lib.lib()
    batch_size = ctypes.c_int32(0)
    encoded = name.encode()
    _errors.check(lib.jagflash_generate_lengths(encoded, seed, None, 0, ctypes.byref(batch_size)), lib)
    lengths = (ctypes.c_int32 * batch_size.value)()
    _errors.check(lib.jagflash_generate_lengths(encoded, seed, lengths, batch_size.value, ctypes.byref(batch_size)), lib)
    return list(lengths)


def visible_pairs(len_q: int, len_kv: int, *, causal: bool = False, window: Tuple[int, int] = (-1, -1)) -> int:
    """Number of (query, key) pairs one sequence computes under the mask; useful FLOPs of the
    forward are 4 * H * D * the sum over sequences (the backward's 2.5 times that)."""
    mask, left, right = mask_args(causal, window)
    for name, length in (("len_q", len_q), ("len_kv", len_kv)):
        # ctypes would truncate a float or wrap a length past int32 without a word; the C call
        # judges the rest (a negative length among them).
        if isinstance(length, bool) or not isinstance(length, int) or not -(2**31) <= length < 2**31:
            raise _errors.invalid_argument(name, "an int that fits int32", repr(length))
    lib = _lib.lib()
    pairs = lib.jagflash_visible_pairs(len_q, len_kv, mask, left, right)
    # -1 is the C call's only error report (no count equals it); the reason is in last_error.
    if pairs == -1:
        message = lib.jagflash_last_error().decode("utf-8", errors="replace")
        raise _errors.InvalidArgumentError(message, _capi.ERR_INVALID_ARGUMENT)
    return int(pairs)
