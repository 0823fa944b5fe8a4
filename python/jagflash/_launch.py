"""Torch tensors -> one call of the compiled binding (torch.ops.jagflash_c.fwd / .bwd,
python/binding/jagflash_torch.cpp) -> the C library's jagflash_fwd / jagflash_bwd.

No math here, and little else: the binding checks the inputs, copies layouts the C API cannot
read, allocates the outputs and the workspace through torch (on the tensors' device, on the
current stream), fills the C structs and calls the library. This file passes the offsets check
mode the binding is to use (_offsets_check.launch_value, decided when the call runs), keeps the
workspace of a "device"-checked call (read_device_error), warns once when the slow path served a
CUDA call, and turns the binding's errors into the package's exceptions with the C library's
message. The ctypes descriptions below serve jagflash.backend() and that warning only.
"""
import contextlib
import re
from operator import itemgetter

import torch

from . import _backend, _capi, _errors, _lib, _offsets_check
from ._problem import POOLED_FIELDS, Problem, backward_op_args


_DTYPES = {torch.bfloat16: _capi.BF16, torch.float16: _capi.FP16, torch.float32: _capi.FP32}
# The GPU path loads with TMA: bases and strides must be multiples of 16 bytes.
_GPU_ALIGN_BYTES = 16


def check_inputs(q, k, v, q_offsets, kv_offsets):
    """What must hold before the C library can even be described the call (ranks, one dtype, one
    device, offsets as int32 vectors of one length). Shared by the fake kernels and, on its error
    path, the binding (which detects the same conditions and lets this function word them), so a
    traced call fails where an eager one would. Everything else the C library checks itself."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise _errors.invalid_argument(name, "a [tokens, heads, head_dim] tensor", f"shape {tuple(t.shape)}")
    if q.dtype not in _DTYPES:
        raise _errors.invalid_argument("q.dtype", "torch.bfloat16, torch.float16 or torch.float32", q.dtype)
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise _errors.invalid_argument(f"{name}.dtype", f"{q.dtype} (q's dtype)", t.dtype)
    for name, t in (("k", k), ("v", v), ("q_offsets", q_offsets), ("kv_offsets", kv_offsets)):
        if t.device != q.device:
            raise _errors.invalid_argument(f"{name}.device", f"{q.device} (q's device)", t.device)
    if q.device.type not in ("cpu", "cuda"):
        raise _errors.invalid_argument("q.device", "a CPU or CUDA tensor", q.device)
    for name, t in (("q_offsets", q_offsets), ("kv_offsets", kv_offsets)):
        if t.dim() != 1 or t.numel() < 1 or t.dtype != torch.int32:
            raise _errors.invalid_argument(
                name, "an int32 vector of B+1 >= 1 offsets", f"{t.dtype} of shape {tuple(t.shape)}"
            )
    if kv_offsets.numel() != q_offsets.numel():
        raise _errors.invalid_argument(
            "kv_offsets", f"B+1 = {q_offsets.numel()} entries (as many as q_offsets)", kv_offsets.numel()
        )


# Head dims (the C library's rules, include/jagflash/jagflash.h): q's and k's any multiple of 8 from 8
# to 256, v's (and out's, dout's, dv's) one up to q's; on CUDA only what a GPU path serves today.
_HEAD_DIM_STEP, _MAX_HEAD_DIM = 8, 256
_CUDA_HEAD_DIMS = (64, 128, 256)


def check_head_dims(q, k, v, *, backward=False, modified=False, blocked=False, pooled=False):
    """The head dims the C library accepts, with its messages in the ops' terms (q.shape[-1]):
    UnsupportedError for one no path serves, on the tensors' device (on CUDA: v's the same as
    q's but on the Hopper kernels (bf16/fp16, no modifier, no block mask, not `pooled`), and a q head
    dim other than 64, 128 or 256 only where the Hopper kernels take it: bf16 or fp16, no score
    modifier (`modified`) and no block mask (`blocked`), either direction up to 256: `backward`
    changes nothing, as in the C library), InvalidArgumentError for k's differing from q's. The
    fake kernels and jagflash.backend() run it, so a traced call fails where an eager one would; an
    eager call leaves it to the C library, which says the same (on a GPU that is not a Hopper one
    it also refuses what only the Hopper kernels serve)."""
    d, dv = q.shape[-1], v.shape[-1]
    if d < _HEAD_DIM_STEP or d > _MAX_HEAD_DIM or d % _HEAD_DIM_STEP != 0:
        raise _errors.UnsupportedError(f"q.shape[-1]: expected a multiple of 8 from 8 to 256, got {d}",
                                       _capi.ERR_UNSUPPORTED)
    if dv < _HEAD_DIM_STEP or dv > d or dv % _HEAD_DIM_STEP != 0:
        raise _errors.UnsupportedError(f"v.shape[-1]: expected a multiple of 8 from 8 to q's head dim ({d}), got {dv}",
                                       _capi.ERR_UNSUPPORTED)
    if q.device.type == "cuda":
        # The Hopper kernels (their padded ones below 64 / 128 / 256): bf16/fp16, no score modifier,
        # no block mask, either direction, every head dim checked above.
        hopper = q.dtype in (torch.bfloat16, torch.float16) and not modified and not blocked
        # A narrower v: the Hopper kernels' padded ones (not pooled). Named before q's head dim, as
        # the C library does (require_served_head_dim), so both refuse 192 / 128 with a modifier alike.
        if dv != d and not (hopper and not pooled):
            raise _errors.UnsupportedError(
                f"v.shape[-1]: expected q's head dim ({d}) for this call on CUDA (a v head dim of its own, {dv} "
                f"here, runs on the Hopper kernels with bf16/fp16, no score modifier, no block mask, not pooled, "
                f"either direction; otherwise on CPU tensors only so far), got {dv}",
                _capi.ERR_UNSUPPORTED)
        if d not in _CUDA_HEAD_DIMS and not hopper:
            raise _errors.UnsupportedError(
                f"q.shape[-1]: expected 64, 128 or 256 for this call on CUDA (head dim {d} runs on the Hopper "
                f"kernels with bf16/fp16 and no score modifier, either direction; otherwise on CPU tensors only so "
                f"far), got {d}", _capi.ERR_UNSUPPORTED)
    if k.shape[-1] != d:
        raise _errors.invalid_argument("k.shape[-1]", d, k.shape[-1])


def check_score_mod(q, softcap, alibi_slopes, score_mod=0, score_mod_table=None):
    """The score modifier in the ops' terms (softcap: 0 = none, else > 0 and finite and non-zero as
    a float32, as scale; alibi_slopes:
    None or float32 [H] on q's device; score_mod, score_mod_table: 0 and None, or the jf_score_mod of
    a modifier that reads a table and that table, float32 [H, W] on q's device; one at a time). The C library checks the same
    (jf_score_mod); this says it in the caller's words, also for the fake kernels and
    jagflash.backend(), so a traced call fails where an eager one would."""
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise _errors.invalid_argument("softcap", "a real number (0 = no softcap)", repr(softcap))
    if softcap != 0 and not _SCALE_ROUNDS_TO_ZERO < softcap < _SCALE_ROUNDS_TO_INF:  # NaN fails too
        raise _errors.invalid_argument("softcap", "a finite number > 0 that stays finite and non-zero in float32 "
                                       "(0 = no softcap)", repr(softcap))
    if alibi_slopes is not None:
        heads = q.shape[1]
        if not isinstance(alibi_slopes, torch.Tensor) or alibi_slopes.dtype != torch.float32 or \
                tuple(alibi_slopes.shape) != (heads,) or alibi_slopes.device != q.device:
            got = (f"{alibi_slopes.dtype} {tuple(alibi_slopes.shape)} on {alibi_slopes.device}"
                   if isinstance(alibi_slopes, torch.Tensor) else type(alibi_slopes).__name__)
            raise _errors.invalid_argument("alibi_slopes", f"float32 ({heads},) (one slope per query head) on {q.device}",
                                           got)
        if softcap != 0:
            raise _errors.invalid_argument("softcap", "0 with alibi_slopes (one score modifier at a time)",
                                           repr(softcap))
    if score_mod or score_mod_table is not None:
        heads = q.shape[1]
        if isinstance(score_mod, bool) or not isinstance(score_mod, int) or score_mod <= _capi.SCORE_MOD_ALIBI:
            raise _errors.invalid_argument("score_mod", "the jf_score_mod of a modifier with a table "
                                           "(jagflash.score_mod_kind(name))", repr(score_mod))
        if not isinstance(score_mod_table, torch.Tensor) or score_mod_table.dtype != torch.float32 or \
                score_mod_table.dim() != 2 or score_mod_table.shape[0] != heads or score_mod_table.shape[1] < 1 or \
                score_mod_table.device != q.device:
            got = (f"{score_mod_table.dtype} {tuple(score_mod_table.shape)} on {score_mod_table.device}"
                   if isinstance(score_mod_table, torch.Tensor) else type(score_mod_table).__name__)
            raise _errors.invalid_argument("score_mod_table", f"float32 ({heads}, W) (a row per query head) on "
                                           f"{q.device}", got)
        if softcap != 0 or alibi_slopes is not None:
            raise _errors.invalid_argument("softcap" if softcap != 0 else "alibi_slopes",
                                           "unset with score_mod_table (one score modifier at a time)",
                                           repr(softcap) if softcap != 0 else "a tensor")


# The sinks' dtypes the package takes (a model's parameter in its dtype); the C API reads float32.
_SINK_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_learnable_sink(q, learnable_sink):
    """The sinks in the ops' terms: None, or one logit per query head, a (H,) tensor of float32,
    bfloat16 or float16 on q's device (_checked_extras converts it to the contiguous float32 the C
    API reads). The binding checks the converted tensor; this says it in the caller's words, also
    for the fake kernels, so a traced call fails where an eager one would. Their values (finite)
    are the C library's to check."""
    if learnable_sink is None or q.dim() != 3:  # q's own shape is check_inputs' to name
        return
    heads = q.shape[1]
    if isinstance(learnable_sink, torch.Tensor) and learnable_sink.dtype in _SINK_DTYPES and \
            tuple(learnable_sink.shape) == (heads,) and learnable_sink.device == q.device:
        return
    got = (f"{learnable_sink.dtype} {tuple(learnable_sink.shape)} on {learnable_sink.device}"
           if isinstance(learnable_sink, torch.Tensor) else type(learnable_sink).__name__)
    raise _errors.invalid_argument("learnable_sink", f"a float32, bfloat16 or float16 tensor of shape ({heads},) (one "
                                   f"logit per query head) on {q.device} (q's device)", got)


def check_sink_grad(learnable_sink, learnable_sink_grad):
    """A backward op's learnable_sink_grad: a bool, and True only with sinks to differentiate."""
    if not isinstance(learnable_sink_grad, bool):
        raise _errors.invalid_argument("learnable_sink_grad", "True or False", repr(learnable_sink_grad))
    if learnable_sink_grad and learnable_sink is None:
        raise _errors.invalid_argument("learnable_sink_grad", "False without learnable_sink (there is no sink to "
                                       "differentiate)", repr(learnable_sink_grad))


def check_block_mask(q, q_offsets, blocks, offsets):
    """The block mask in the ops' terms: none (both None) or blocks a uint8 vector and offsets an
    int32 vector of B+1 entries (as many as q_offsets), both on q's device. The values (offsets[0]
    == 0, offsets[b+1] - offsets[b] == ceil(Lq_b / 128) * ceil(Lk_b / 128)) are the C library's to
    check, as it checks q_offsets; the fake kernels run this so a traced call fails where an eager
    one would."""
    if blocks is None and offsets is None:
        return
    if blocks is None or offsets is None:
        missing = "block_mask_blocks" if blocks is None else "block_mask_offsets"
        raise _errors.invalid_argument(missing, "a tensor (a block mask has both blocks and offsets)", "None")
    if not isinstance(blocks, torch.Tensor) or blocks.dtype != torch.uint8 or blocks.dim() != 1 or \
            blocks.device != q.device:
        got = (f"{blocks.dtype} of shape {tuple(blocks.shape)} on {blocks.device}" if isinstance(blocks, torch.Tensor)
               else type(blocks).__name__)
        raise _errors.invalid_argument("block_mask.blocks", f"a uint8 vector on {q.device} (q's device)", got)
    expected = q_offsets.numel()
    if not isinstance(offsets, torch.Tensor) or offsets.dtype != torch.int32 or offsets.dim() != 1 or \
            offsets.numel() != expected or offsets.device != q.device:
        got = (f"{offsets.dtype} of shape {tuple(offsets.shape)} on {offsets.device}"
               if isinstance(offsets, torch.Tensor) else type(offsets).__name__)
        raise _errors.invalid_argument("block_mask.offsets", f"an int32 vector of B+1 = {expected} entries on "
                                       f"{q.device} (q's device)", got)


# The op-level scale (and softcap): 0 is the C API's marker for 1/sqrt(D) (no softcap); any other
# value must stay finite and non-zero as the float32 the C API holds (the binding checks the same: check_scale in
# python/binding/jagflash_torch.cpp). Bounds as in functional._scale.
_SCALE_ROUNDS_TO_ZERO = 2.0**-150
_SCALE_ROUNDS_TO_INF = 2.0**128 - 2.0**103


def check_op_scalars(scale, check_offsets):
    """The ops' scalars that the binding checks before the call, checked the same way by the fake
    kernels, so a traced call fails where an eager one would."""
    if scale != 0 and not _SCALE_ROUNDS_TO_ZERO < abs(scale) < _SCALE_ROUNDS_TO_INF:
        raise _errors.invalid_argument(
            "scale", "0 (1/sqrt(head_dim)) or a number that is finite and non-zero in float32", repr(scale))
    _offsets_check.validate_op_mode(check_offsets)


def check_backward_inputs(dout, q, k, v, out, lse, q_offsets, kv_offsets):
    """check_inputs, and dout / out [total_q, H, Dv] in q's dtype and device (Dv: v's head dim),
    lse float32 [H, total_q] (the C API takes lse as a bare pointer: its shape and dtype can only
    be checked before the call)."""
    check_inputs(q, k, v, q_offsets, kv_offsets)
    shape = (q.shape[0], q.shape[1], v.shape[-1])
    for name, t in (("dout", dout), ("out", out)):
        if t.shape != shape or t.dtype != q.dtype or t.device != q.device:
            raise _errors.invalid_argument(
                name, f"{q.dtype} {shape} on {q.device} (q's rows and heads, v's head dim)",
                f"{t.dtype} {tuple(t.shape)} on {t.device}"
            )
    if lse.shape != (q.shape[1], q.shape[0]) or lse.dtype != torch.float32 or lse.device != q.device:
        raise _errors.invalid_argument(
            "lse", f"float32 [H, total_q] = {[q.shape[1], q.shape[0]]} on {q.device}",
            f"{lse.dtype} {list(lse.shape)} on {lse.device}",
        )


def check_pooled_inputs(q, k, v, kv_offsets):
    """check_inputs for pooled attention: q [Lq, H, D] with Lq >= 1 (shared by every sequence), k, v
    [total_kv, H_kv, D], kv_offsets int32 [B+1]; no q_offsets."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise _errors.invalid_argument(name, "a [tokens, heads, head_dim] tensor", f"shape {tuple(t.shape)}")
    if q.shape[0] < 1:
        raise _errors.invalid_argument("q", "a query set [Lq, H, D] with Lq >= 1", f"shape {tuple(q.shape)}")
    if q.dtype not in _DTYPES:
        raise _errors.invalid_argument("q.dtype", "torch.bfloat16, torch.float16 or torch.float32", q.dtype)
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise _errors.invalid_argument(f"{name}.dtype", f"{q.dtype} (q's dtype)", t.dtype)
    for name, t in (("k", k), ("v", v), ("kv_offsets", kv_offsets)):
        if t.device != q.device:
            raise _errors.invalid_argument(f"{name}.device", f"{q.device} (q's device)", t.device)
    if q.device.type not in ("cpu", "cuda"):
        raise _errors.invalid_argument("q.device", "a CPU or CUDA tensor", q.device)
    if kv_offsets.dim() != 1 or kv_offsets.numel() < 1 or kv_offsets.dtype != torch.int32:
        raise _errors.invalid_argument(
            "kv_offsets", "an int32 vector of B+1 >= 1 offsets", f"{kv_offsets.dtype} of shape {tuple(kv_offsets.shape)}"
        )


def check_pooled_backward_inputs(dout, q, k, v, out, lse, kv_offsets):
    """check_pooled_inputs, and dout / out [B*Lq, H, Dv] in q's dtype, lse float32 [H, B*Lq]."""
    check_pooled_inputs(q, k, v, kv_offsets)
    rows = (kv_offsets.numel() - 1) * q.shape[0]
    shape = (rows, q.shape[1], v.shape[2])
    for name, t in (("dout", dout), ("out", out)):
        if t.shape != shape or t.dtype != q.dtype or t.device != q.device:
            raise _errors.invalid_argument(
                name, f"{q.dtype} [B*Lq, H, Dv] = {list(shape)} on {q.device}", f"{t.dtype} {list(t.shape)} on {t.device}"
            )
    if lse.shape != (q.shape[1], rows) or lse.dtype != torch.float32 or lse.device != q.device:
        raise _errors.invalid_argument(
            "lse", f"float32 [H, B*Lq] = {[q.shape[1], rows]} on {q.device}",
            f"{lse.dtype} {list(lse.shape)} on {lse.device}",
        )


# "[jagflash status N] message": how the binding reports a failed call (a RuntimeError to Python).
_BINDING_ERROR = re.compile(r"\[jagflash status (\d+)\] (.*)", re.S)
_INPUT_CHECK = "input check: "


_OUT_OF_MEMORY = re.compile(r"out of memory: (.*), (\d+) bytes, on (cpu|cuda:\d+)$")
# What a backward's workspace is, for the error that says it did not fit (README, "Out of memory").
_WORKSPACE_NOTE = {
    "the backward's workspace": " (mostly the fp32 dQ accumulator, 4 * total_q * H * the kernel's head dim bytes)",
}


def _gib(size):
    return f"{size / 2**30:.2f} GiB"


def out_of_memory(message):
    """torch.OutOfMemoryError (torch.cuda.OutOfMemoryError) for the binding's "out of memory: WHAT,
    N bytes, on DEVICE", worded as PyTorch's allocator words its own: the size asked for and, on
    CUDA, the device's capacity and free memory (read on this error path only). None for any other
    message."""
    found = _OUT_OF_MEMORY.match(message)
    if found is None:
        return None
    what, size, device = found.group(1), int(found.group(2)), torch.device(found.group(3))
    text = (f"jagflash: {'CUDA' if device.type == 'cuda' else 'CPU'} out of memory. Tried to allocate {_gib(size)} "
            f"({size} bytes) for {what}{_WORKSPACE_NOTE.get(what, '')}.")
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        text += (f" GPU {device.index} has a total capacity of {_gib(total)} of which {_gib(free)} is free; "
                 f"{_gib(torch.cuda.memory_reserved(device))} is reserved by PyTorch's allocator.")
    return torch.OutOfMemoryError(text)


def _translated(error, recheck):
    """The package's exception for a RuntimeError the binding raised (the C library's message
    and status; torch.OutOfMemoryError for an allocation that did not fit); the error itself if it
    did not come from the binding. A failed input check is worded by `recheck` (check_inputs and
    friends), which raises."""
    found = _BINDING_ERROR.search(str(error))
    if found is None:
        return error
    status, message = int(found.group(1)), found.group(2).rstrip()
    if message.startswith(_INPUT_CHECK):
        recheck()
    oom = out_of_memory(message)
    if oom is not None:
        return oom
    return _errors._BY_STATUS.get(status, _errors.JagflashError)(message, status)


_fwd_op = None
_bwd_op = None


def _ops():
    """The binding's two ops, loaded (libjagflash.so first, then the binding) on first use: the
    overloads' own callables (OpOverload.__call__ only forwards to them, one Python frame more)."""
    global _fwd_op, _bwd_op
    _lib.binding()
    _fwd_op, _bwd_op = torch.ops.jagflash_c.fwd.default._op, torch.ops.jagflash_c.bwd.default._op
    return _fwd_op, _bwd_op


def _pooled_ops():
    """The binding's pooled ops (torch.ops.jagflash_c.pooled_fwd / .pooled_bwd)."""
    _lib.binding()
    return torch.ops.jagflash_c.pooled_fwd.default, torch.ops.jagflash_c.pooled_bwd.default


# The binding's ops take a Problem's fields as the custom ops do (Problem.op_args, and dout, out
# and lse where backward_op_args puts them), but for two: check_offsets arrives as the launch's
# offsets_check (an int, decided when the call runs: _offsets_check.launch_value), and the
# forwards take no deterministic (the forward always is). test_problem.py holds these layouts to
# the binding's schemas (python/binding/jagflash_torch.cpp).
def binding_fields(pooled=False, backward=False):
    """The Problem fields a binding op takes, in its order (check_offsets where offsets_check goes;
    a backward op's dout, out and lse not included)."""
    fields = POOLED_FIELDS if pooled else Problem._fields
    return tuple(name for name in fields if backward or name != "deterministic")


def _binding_layout(pooled, backward):
    """Getters of binding_fields' values from a Problem, as tuples: those before check_offsets and
    those after it (several on each side: itemgetter returns a lone value bare). C getters rather
    than a loop over the names: the eager call's host time counts."""
    names = binding_fields(pooled, backward)
    at = names.index("check_offsets")
    return tuple(itemgetter(*(Problem._fields.index(name) for name in part)) for part in (names[:at], names[at + 1:]))


_FWD_LAYOUT, _BWD_LAYOUT = _binding_layout(False, False), _binding_layout(False, True)
_POOLED_FWD_LAYOUT, _POOLED_BWD_LAYOUT = _binding_layout(True, False), _binding_layout(True, True)


def _binding_args(layout, problem, device):
    """A binding op's arguments for problem on device (a backward op's: backward_op_args of these)."""
    before, after = layout
    return (*before(problem), _offsets_check.launch_value(problem.check_offsets, device), *after(problem))


# The sinks' arguments are the last of every binding op, with defaults (learnable_sink=None, and the
# backwards' dlearnable_sink=None, where the custom ops take learnable_sink_grad): a call without
# sinks leaves them out, so it boxes one argument (two) less and a binding built before the sinks
# still serves it with its library.
def _forward_binding_args(layout, problem, device):
    """A binding forward op's arguments for problem on device."""
    args = _binding_args(layout, problem, device)
    return args if problem.learnable_sink is not None else args[:-1]


def _backward_binding_args(layout, problem, device, out, lse, dout, dlearnable_sink):
    """A binding backward op's arguments for problem on device; dlearnable_sink: where the sinks'
    gradient goes, None for none."""
    args = backward_op_args(_binding_args(layout, problem, device), out, lse, dout, dlearnable_sink)
    return args if problem.learnable_sink is not None else args[:-2]


def _sink_gradient_buffer(problem, learnable_sink_grad):
    """Where the binding writes the sinks' gradient (float32 [H], jf_bwd_args.dlearnable_sink) when
    it is wanted; None (no gradient computed) otherwise."""
    if learnable_sink_grad is False:
        return None
    check_sink_grad(problem.learnable_sink, learnable_sink_grad)
    q = problem.q
    return torch.empty(q.shape[1], dtype=torch.float32, device=q.device)


# (direction, dtype, head dim, device index) already shown to _backend.note_cuda_call: which path
# serves a call depends on nothing else, so the warning is decided once per key.
_noted = set()


def _note_cuda_call(direction, problem, pooled=False):
    """SlowPathWarning, once per process, when the oracle served a CUDA call (_backend). pooled:
    q is a pooled query set (kv_offsets alone give the batch). The block mask and the sinks are
    part of the question, as the choice of path may depend on them; the mask, scale and score
    modifier are not."""
    if _backend._warned:
        return
    q = problem.q
    device = q.device
    key = (direction, q.dtype, q.shape[2], device.index, pooled, problem.block_mask_blocks is not None,
           problem.learnable_sink is not None)
    if key in _noted:
        return
    _noted.add(key)
    bare = problem._replace(q=_prepared(q), k=_prepared(problem.k), v=_prepared(problem.v), mask=_capi.MASK_NONE,
                            window_left=-1, window_right=-1, scale=0.0, softcap=0.0, alibi_slopes=None, score_mod=0,
                            score_mod_table=None)
    args_type = _capi.BwdArgs if direction == _backend.DIRECTION_BACKWARD else _capi.FwdArgs
    args = args_type(problem=describe(bare, pooled=pooled), launch=_capi.Launch(backend=_capi.BACKEND_AUTO))
    with _device_guard(device):
        _backend.note_cuda_call(args, device)


def _dense_slopes(alibi_slopes):
    """The slopes (or a modifier's table) as the C API reads them (a bare float pointer): a strided
    view is copied."""
    if alibi_slopes is None or alibi_slopes.is_contiguous():
        return alibi_slopes
    return alibi_slopes.contiguous()


def float32_sink(learnable_sink):
    """The sinks as the C API reads them (a bare float pointer): a copy in float32 when they are in
    another dtype or strided, never the caller's tensor written."""
    if learnable_sink.dtype is torch.float32 and learnable_sink.is_contiguous():
        return learnable_sink
    return learnable_sink.to(torch.float32).contiguous()


def _checked_extras(problem, pooled=False):
    """problem with its score modifier, block mask and sinks checked in the ops' terms
    (check_score_mod, check_block_mask, check_learnable_sink) and the modifier's tensors and the
    sinks made dense (the sinks float32); problem itself when it has none of them."""
    if problem.softcap or problem.alibi_slopes is not None or problem.score_mod or \
            problem.score_mod_table is not None:
        check_score_mod(problem.q, problem.softcap, problem.alibi_slopes, problem.score_mod, problem.score_mod_table)
        problem = problem._replace(alibi_slopes=_dense_slopes(problem.alibi_slopes),
                                   score_mod_table=_dense_slopes(problem.score_mod_table))
    if not pooled and (problem.block_mask_blocks is not None or problem.block_mask_offsets is not None):
        check_block_mask(problem.q, problem.q_offsets, problem.block_mask_blocks, problem.block_mask_offsets)
    if problem.learnable_sink is not None:
        check_learnable_sink(problem.q, problem.learnable_sink)
        problem = problem._replace(learnable_sink=float32_sink(problem.learnable_sink))
    return problem


def _recheck(problem, pooled=False, backward=None):
    """The input checks that word a failed binding check (see _translated). backward: the call's
    (dout, out, lse), whose shapes are checked too."""
    p = problem
    if pooled and backward:
        check_pooled_backward_inputs(backward[0], p.q, p.k, p.v, backward[1], backward[2], p.kv_offsets)
    elif pooled:
        check_pooled_inputs(p.q, p.k, p.v, p.kv_offsets)
    elif backward:
        check_backward_inputs(backward[0], p.q, p.k, p.v, backward[1], backward[2], p.q_offsets, p.kv_offsets)
    else:
        check_inputs(p.q, p.k, p.v, p.q_offsets, p.kv_offsets)
    check_score_mod(p.q, p.softcap, p.alibi_slopes, p.score_mod, p.score_mod_table)
    if not pooled:
        check_block_mask(p.q, p.q_offsets, p.block_mask_blocks, p.block_mask_offsets)
    check_learnable_sink(p.q, p.learnable_sink)


def forward(problem):
    """out [total_q, H, Dv] (q's dtype, v's head dim) and lse [H, total_q] (float32) of a Problem
    (its deterministic is the backward's: the forward always is)."""
    fwd_op = _fwd_op or _ops()[0]
    p = _checked_extras(problem)
    device = p.q.device
    try:
        out, lse, workspace = fwd_op(*_forward_binding_args(_FWD_LAYOUT, p, device))
    except RuntimeError as error:
        raise _translated(error, lambda: _recheck(p)) from None
    _offsets_check.remember("forward", p.check_offsets, workspace)
    if device.type == "cuda":
        _note_cuda_call(_backend.DIRECTION_FORWARD, p)
    return out, lse


def backward(problem, out, lse, dout, learnable_sink_grad=False):
    """dq, dk, dv in the inputs' dtype and shapes of the Problem whose forward gave out and lse
    (dout [.., Dv] like out); with GQA dk/dv sum over each group's query heads. Then the sinks'
    gradient, float32 [H], with learnable_sink_grad (the problem has sinks), else None. The
    problem's deterministic: dq bitwise identical from run to run too (jf_launch.deterministic; dk,
    dv and the sinks' gradient always are)."""
    bwd_op = _bwd_op or _ops()[1]
    p = _checked_extras(problem)
    device = p.q.device
    dsink = _sink_gradient_buffer(p, learnable_sink_grad)
    try:
        dq, dk, dv, workspace = bwd_op(*_backward_binding_args(_BWD_LAYOUT, p, device, out, lse, dout, dsink))
    except RuntimeError as error:
        raise _translated(error, lambda: _recheck(p, backward=(dout, out, lse))) from None
    _offsets_check.remember("backward", p.check_offsets, workspace)
    if device.type == "cuda":
        _note_cuda_call(_backend.DIRECTION_BACKWARD, p)
    return dq, dk, dv, dsink


# The C structs described from Python, for what the binding does not do: the backend query
# (jagflash.backend, the slow-path warning). The binding applies the same layout rules.
def _strides(t):
    """(row_stride, head_stride) as the C API reads them. A stride over a dimension of size 1 is
    never used to address anything, so it is replaced by the smallest legal one (torch leaves
    arbitrary values there)."""
    rows, heads, head_dim = t.shape
    if t.numel() == 0:  # nothing addressed: dense strides (an expanded empty tensor has 0)
        return heads * head_dim, head_dim
    head_stride = t.stride(1) if heads > 1 else head_dim
    row_stride = t.stride(0) if rows > 1 else (heads - 1) * head_stride + head_dim
    return row_stride, head_stride


def _usable(t):
    """Whether the C API accepts t's layout as is: contiguous head dim, rows and heads that do
    not overlap, rows outermost, and on the GPU 16-byte aligned base and strides."""
    if t.numel() == 0:
        return True
    _, heads, head_dim = t.shape
    row_stride, head_stride = _strides(t)
    if t.stride(2) != 1 and head_dim > 1:
        return False
    if head_stride < head_dim or row_stride < (heads - 1) * head_stride + head_dim:
        return False
    if t.is_cuda:
        unit = _GPU_ALIGN_BYTES // t.element_size()
        if t.data_ptr() % _GPU_ALIGN_BYTES or row_stride % unit or (heads > 1 and head_stride % unit):
            return False
    return True


def _prepared(t):
    """t itself when the C API can read it in place, else a dense copy (a fresh allocation, so
    also 16-byte aligned)."""
    return t if _usable(t) else t.clone(memory_format=torch.contiguous_format)


def _describe(t):
    row_stride, head_stride = _strides(t)
    return _capi.Tensor(t.data_ptr() or None, t.shape[0], t.shape[1], t.shape[2], row_stride, head_stride)


def _problem(q, k, v, q_offsets, kv_offsets, mask, window_left, window_right, scale):
    return _capi.Problem(
        dtype=_DTYPES[q.dtype],
        device=_capi.DEVICE_CUDA if q.is_cuda else _capi.DEVICE_CPU,
        batch_size=q_offsets.numel() - 1,
        q_offsets=q_offsets.data_ptr(),
        kv_offsets=kv_offsets.data_ptr(),
        q=_describe(q),
        k=_describe(k),
        v=_describe(v),
        mask=mask,
        window_left=window_left,
        window_right=window_right,
        scale=scale,
    )


def describe(problem, pooled=False):
    """The jf_problem of a Problem whose q, k and v the C API reads in place (_prepared), score
    modifier, block mask and sinks (float32, dense: _checked_extras) included; pooled: q is a pooled
    query set (no q_offsets). The struct holds bare pointers: the problem's tensors must outlive it."""
    q, kv_offsets = problem.q, problem.kv_offsets
    c_problem = _problem(q, problem.k, problem.v, kv_offsets if pooled else problem.q_offsets, kv_offsets,
                         problem.mask, problem.window_left, problem.window_right, problem.scale)
    if pooled:
        c_problem.q_offsets = None
        c_problem.pooled_q_rows = q.shape[0]
    if problem.alibi_slopes is not None:
        c_problem.score_mod, c_problem.alibi_slopes = _capi.SCORE_MOD_ALIBI, problem.alibi_slopes.data_ptr()
    elif problem.softcap:
        c_problem.score_mod, c_problem.softcap = _capi.SCORE_MOD_SOFTCAP, problem.softcap
    elif problem.score_mod:
        c_problem.score_mod, c_problem.score_mod_table = problem.score_mod, problem.score_mod_table.data_ptr()
        c_problem.score_mod_table_width = problem.score_mod_table.shape[1]
    blocks, block_offsets = problem.block_mask_blocks, problem.block_mask_offsets
    if blocks is not None:
        # An empty map is still a map: as the binding does, blocks then points at the offsets (torch
        # may give an empty tensor no address, and NULL blocks beside offsets is a half-given mask).
        blocks_ptr = blocks.data_ptr() if blocks.numel() else block_offsets.data_ptr()
        c_problem.block_mask = _capi.BlockMask(blocks_ptr, block_offsets.data_ptr(), blocks.numel())
    if problem.learnable_sink is not None:
        c_problem.learnable_sink = problem.learnable_sink.data_ptr()
    return c_problem


def _device_guard(device):
    """The C library works on the current CUDA device: make it the tensors' one."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def pooled_forward(problem):
    """Pooled attention (jf_problem.pooled_q_rows) of a Problem without q_offsets or block mask:
    q [Lq, H, D] shared by the B sequences of kv_offsets; out [B*Lq, H, Dv] (q's dtype), lse
    [H, B*Lq] (float32)."""
    fwd_op = _pooled_ops()[0]
    p = _checked_extras(problem, pooled=True)
    device = p.q.device
    try:
        out, lse, workspace = fwd_op(*_forward_binding_args(_POOLED_FWD_LAYOUT, p, device))
    except RuntimeError as error:
        raise _translated(error, lambda: _recheck(p, pooled=True)) from None
    _offsets_check.remember("forward", p.check_offsets, workspace)
    if device.type == "cuda":
        _note_cuda_call(_backend.DIRECTION_FORWARD, p, pooled=True)
    return out, lse


def pooled_backward(problem, out, lse, dout, learnable_sink_grad=False):
    """dq [Lq, H, D] (the sum over the sequences), dk, dv per sequence, in the inputs' dtype; the
    sinks' gradient as backward's."""
    bwd_op = _pooled_ops()[1]
    p = _checked_extras(problem, pooled=True)
    device = p.q.device
    dsink = _sink_gradient_buffer(p, learnable_sink_grad)
    try:
        dq, dk, dv, workspace = bwd_op(*_backward_binding_args(_POOLED_BWD_LAYOUT, p, device, out, lse, dout,
                                                               dsink))
    except RuntimeError as error:
        raise _translated(error, lambda: _recheck(p, pooled=True, backward=(dout, out, lse))) from None
    _offsets_check.remember("backward", p.check_offsets, workspace)
    if device.type == "cuda":
        _note_cuda_call(_backend.DIRECTION_BACKWARD, p, pooled=True)
    return dq, dk, dv, dsink
