"""jagflash: FlashAttention for jagged (packed variable-length) batches, as PyTorch ops.

    out = jagflash.jagged_attention(q, k, v, q_offsets, causal=True)   # [total, H, D] + offsets
    out = jagflash.attention(q_nt, k_nt, v_nt)                         # torch.nested, jagged
    out = jagflash.pooled_attention(q_set, k, v, kv_offsets)           # one query set [Lq, H, D], pooled
    mask = jagflash.BlockMask.from_fn(fn, q_offsets)                   # block-sparse: 128 x 128 blocks
    out = jagflash.jagged_attention(q, k, v, q_offsets, block_mask=mask)

CUDA tensors run the GPU path, CPU tensors the C++ float64 reference. The ops are registered as
torch.ops.jagflash.fwd / .bwd (fake kernels and autograd included), so torch.compile with
fullgraph=True and CUDA-graph capture hold them. Errors of the C library raise
jagflash.JagflashError (InvalidArgumentError / UnsupportedError) with its message. CUDA calls
never sync: bad offsets found on the device raise at the next call on that device, or at
jagflash.synchronize() (see set_check_offsets).

From existing PyTorch code:
    out = jagflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)  # FA2's signature
    torch.nn.attention.activate_flash_attention_impl("jagflash")  # varlen_attn, nested and dense SDPA
Importing jagflash registers "jagflash" with torch.nn.attention's registry; it activates nothing.
"""
from . import ops, registry
from ._backend import SlowPathWarning
from ._errors import InvalidArgumentError, JagflashError, UnsupportedError
from ._lib import lib as _load_library
from ._lib import library_path
from ._offsets_check import get_check_offsets, read_device_error, set_check_offsets, synchronize
from .block_mask import BlockMask
from .compat import flash_attn_varlen_func
from .functional import attention, backend, jagged_attention, pooled_attention, score_mod_kind
from .lengths import DEFAULT_SEED, DISTRIBUTIONS, generate_lengths, visible_pairs

__version__ = "0.1.0"

registry.register()


def library_version() -> str:
    """The loaded C library's version string."""
    return _load_library().jagflash_version().decode()


__all__ = [
    "BlockMask",
    "DEFAULT_SEED",
    "DISTRIBUTIONS",
    "InvalidArgumentError",
    "JagflashError",
    "SlowPathWarning",
    "UnsupportedError",
    "attention",
    "backend",
    "flash_attn_varlen_func",
    "generate_lengths",
    "get_check_offsets",
    "jagged_attention",
    "library_path",
    "library_version",
    "ops",
    "pooled_attention",
    "read_device_error",
    "score_mod_kind",
    "registry",
    "set_check_offsets",
    "synchronize",
    "visible_pairs",
]
