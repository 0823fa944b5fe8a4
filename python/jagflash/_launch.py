"""Torch tensors -> the C API's structs -> one jagflash_fwd / jagflash_bwd call.

No math here: this file allocates the outputs and the workspace with torch (on the tensors'
device, on the current stream), describes the tensors to the C library and checks its status.
"""
import contextlib
import ctypes

import torch

from . import _backend, _capi, _errors, _lib, _offsets_check

_DTYPES = {torch.bfloat16: _capi.BF16, torch.float16: _capi.FP16, torch.float32: _capi.FP32}
# The GPU path loads with TMA: bases and strides must be multiples of 16 bytes.
_GPU_ALIGN_BYTES = 16


def check_inputs(q, k, v, q_offsets, kv_offsets):
    """What must hold before the C library can even be described the call (ranks, one dtype, one
    device, offsets as int32 vectors of one length). Shared by the real and the fake kernels, so a
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


def _strides(t):
    """(row_stride, head_stride) as the C API reads them. A stride over a dimension of size 1 is
    never used to address anything, so it is replaced by the smallest legal one (torch leaves
    arbitrary values there)."""
    rows, heads, head_dim = t.shape
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


def _stream(device):
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None


def _call(size_fn, run_fn, args, device, check_mode, max_seqlen, deterministic=False):
    """Workspace query, allocation on the device, then the call; returns the workspace."""
    lib = _lib.lib()
    args.launch.stream = _stream(device)
    args.launch.max_seqlen_hint = max_seqlen
    args.launch.deterministic = int(deterministic)
    args.launch.offsets_check = _offsets_check.launch_value(check_mode, device)
    args.launch.backend = _capi.BACKEND_AUTO
    nbytes = ctypes.c_size_t(0)
    _errors.check(size_fn(ctypes.byref(args), ctypes.byref(nbytes)), lib)
    workspace = torch.empty(nbytes.value, dtype=torch.uint8, device=device) if nbytes.value else None
    args.launch.workspace = workspace.data_ptr() if workspace is not None else None
    args.launch.workspace_bytes = nbytes.value
    _errors.check(run_fn(ctypes.byref(args)), lib)
    if device.type == "cuda":
        _backend.note_cuda_call(args, device)  # SlowPathWarning, once, when the oracle served it
    return workspace


def _device_guard(device):
    """The C library launches on the current CUDA device: make it the tensors' one."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def forward(q, k, v, q_offsets, kv_offsets, mask, window_left, window_right, scale, check_mode, max_seqlen=0):
    """out [total_q, H, D] (q's dtype) and lse [H, total_q] (float32). max_seqlen: 0 or an upper
    bound on every q and kv length (a kernel-choice hint, see jf_launch.max_seqlen_hint)."""
    check_inputs(q, k, v, q_offsets, kv_offsets)
    q, k, v = _prepared(q), _prepared(k), _prepared(v)
    q_offsets, kv_offsets = q_offsets.contiguous(), kv_offsets.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
    args = _capi.FwdArgs(
        problem=_problem(q, k, v, q_offsets, kv_offsets, mask, window_left, window_right, scale),
        out=_describe(out),
        lse=lse.data_ptr() or None,
    )
    lib = _lib.lib()
    with _device_guard(q.device):
        workspace = _call(lib.jagflash_fwd_workspace_size, lib.jagflash_fwd, args, q.device, check_mode, max_seqlen)
    _offsets_check.remember("forward", check_mode, workspace)
    return out, lse


def backward(dout, q, k, v, out, lse, q_offsets, kv_offsets, mask, window_left, window_right, scale, check_mode,
             max_seqlen=0, deterministic=False):
    """dq, dk, dv in the inputs' dtype; with GQA dk/dv sum over each group's query heads.
    deterministic: dq bitwise identical from run to run too (jf_launch.deterministic; dk and dv
    always are)."""
    check_inputs(q, k, v, q_offsets, kv_offsets)
    for name, t in (("dout", dout), ("out", out)):
        if t.shape != q.shape or t.dtype != q.dtype or t.device != q.device:
            raise _errors.invalid_argument(
                name, f"{q.dtype} {tuple(q.shape)} on {q.device} (like q)", f"{t.dtype} {tuple(t.shape)} on {t.device}"
            )
    # The C API takes lse as a bare float pointer: its shape and dtype can only be checked here.
    if lse.shape != (q.shape[1], q.shape[0]) or lse.dtype != torch.float32 or lse.device != q.device:
        raise _errors.invalid_argument(
            "lse", f"float32 [H, total_q] = {[q.shape[1], q.shape[0]]} on {q.device}",
            f"{lse.dtype} {list(lse.shape)} on {lse.device}",
        )
    q, k, v, out, dout = (_prepared(t) for t in (q, k, v, out, dout))
    lse, q_offsets, kv_offsets = lse.contiguous(), q_offsets.contiguous(), kv_offsets.contiguous()
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    args = _capi.BwdArgs(
        problem=_problem(q, k, v, q_offsets, kv_offsets, mask, window_left, window_right, scale),
        out=_describe(out),
        dout=_describe(dout),
        lse=lse.data_ptr() or None,
        dq=_describe(dq),
        dk=_describe(dk),
        dv=_describe(dv),
    )
    lib = _lib.lib()
    with _device_guard(q.device):
        workspace = _call(lib.jagflash_bwd_workspace_size, lib.jagflash_bwd, args, q.device, check_mode, max_seqlen,
                          deterministic)
    _offsets_check.remember("backward", check_mode, workspace)
    return dq, dk, dv
