"""How offsets are validated, and how a device-side check's failure reaches the caller.

  "host"   - offsets are copied to the host and checked before anything runs: bad offsets raise
             InvalidArgumentError at the call, at the cost of a stream sync per offsets vector
             (q's and kv's: two per forward, two per backward). Refused (with an error) while
             the stream is being captured into a CUDA graph.
  "device" - a small kernel checks them: no sync, capturable. On bad offsets the call returns,
             nothing is written (the outputs keep whatever memory they were given), and the
             failure is reported later, as CUDA reports a kernel's error: the next jagflash call
             on that device (either direction, any mode) that starts after the GPU ran the check
             raises InvalidArgumentError ("an earlier jagflash call on CUDA device N ...", then the
             check that failed) and runs nothing; synchronize() raises it at once. Each failure
             is reported once. read_device_error() also reads the flag the last explicit "device"
             call left in its workspace.
  "auto"   - (default) "device" for CUDA tensors: a call never syncs, in training as under capture.
CPU tensors are always checked on the host (for free: the offsets are already there), at the call.
"""
import threading
from typing import Dict, Literal, Optional, Union

import torch

from . import _capi, _errors, _lib

# The values check_offsets= takes (None, where a call accepts it, means the module setting).
CheckOffsets = Literal["auto", "host", "device"]
MODES = ("auto", "host", "device")
# Not a user setting: offsets jagflash builds itself (registry.py's dense SDPA path, fixed-length
# sequences back to back) are valid by construction. They are checked on the device (no sync) and
# their workspace is never remembered, so it cannot displace the one of the caller's last "device"
# call that read_device_error() reads.
BUILT = "built"
_default_mode: CheckOffsets = "auto"
# The workspaces of the last forward and the last backward that ran with check_offsets="device"
# (the device check leaves its flag in them). Process-wide, not per thread: autograd runs CUDA
# backwards on its own threads. Only explicit "device" calls are remembered, so that "auto" under
# capture never keeps a graph-pool allocation alive behind the graph's back.
_remembered: Dict[str, torch.Tensor] = {}
_remembered_lock = threading.Lock()


def _validate(mode: object) -> CheckOffsets:
    if mode not in MODES:
        raise _errors.invalid_argument("check_offsets", '"auto", "host" or "device"', repr(mode))
    return mode  # type: ignore[return-value]  # one of MODES, checked above


def set_check_offsets(mode: CheckOffsets) -> None:
    """Sets the mode used when a call passes check_offsets=None (the default; starts as "auto")."""
    global _default_mode
    _default_mode = _validate(mode)


def get_check_offsets() -> CheckOffsets:
    """The mode used when a call passes check_offsets=None."""
    return _default_mode


def resolve(mode: Optional[CheckOffsets]) -> CheckOffsets:
    """A call's check_offsets argument (None = the module setting), validated."""
    return _default_mode if mode is None else _validate(mode)


def validate_op_mode(mode: object) -> None:
    """The modes the ops take: MODES, and BUILT from registry.py."""
    if mode not in MODES and mode != BUILT:
        raise _errors.invalid_argument("check_offsets", '"auto", "host" or "device"', repr(mode))


def launch_value(mode: CheckOffsets, device: torch.device) -> int:
    """jf_offsets_check for one call: "host" only when asked for, or for CPU tensors (whose
    offsets the C library checks on the host whatever it is told). Any other string is refused
    (the ops can be called directly, with no resolve() before)."""
    if mode in ("device", BUILT) or (mode == "auto" and device.type == "cuda"):
        return _capi.CHECK_OFFSETS_DEVICE
    if mode != "host" and mode != "auto":
        validate_op_mode(mode)
    return _capi.CHECK_OFFSETS_HOST


def remember(direction: str, mode: CheckOffsets, workspace: Optional[torch.Tensor]) -> None:
    """Keeps the workspace of an explicit "device" call so read_device_error() can read its flag."""
    if mode == "device" and workspace is not None and workspace.is_cuda:
        with _remembered_lock:
            _remembered[direction] = workspace


def read_device_error() -> None:
    """Synchronises and raises InvalidArgumentError if the last forward or the last backward run
    with check_offsets="device" (eagerly, or captured and then replayed in a CUDA graph) found bad
    offsets (again at every read, until such a call runs again); then, as synchronize() does, if
    any call on the current CUDA device (the default "auto" included) found bad offsets that no
    call has reported yet."""
    lib = _lib.lib()
    with _remembered_lock:
        workspaces = list(_remembered.values())
    for workspace in workspaces:
        with torch.cuda.device(workspace.device):
            stream = torch.cuda.current_stream(workspace.device)
            torch.cuda.synchronize(workspace.device)
            _errors.check(lib.jagflash_read_device_error(workspace.data_ptr(), stream.cuda_stream), lib)
    synchronize()


def _cuda_device(device: object) -> Union[torch.device, int, None]:
    """synchronize's argument checked with or without CUDA: None (the current device), a CUDA
    device index >= 0, or a CUDA torch.device or its string ("cuda", "cuda:1")."""
    if device is None:
        return None
    expected = "None, a CUDA device index or a CUDA device (torch.device or a string such as \"cuda:0\")"
    if isinstance(device, bool):
        raise _errors.invalid_argument("device", expected, repr(device))
    if isinstance(device, int):
        if device < 0:
            raise _errors.invalid_argument("device", expected, repr(device))
        return device
    if isinstance(device, str):
        try:
            parsed = torch.device(device)
        except RuntimeError:
            raise _errors.invalid_argument("device", expected, repr(device)) from None
    elif isinstance(device, torch.device):
        parsed = device
    else:
        raise _errors.invalid_argument("device", expected, type(device).__name__)
    if parsed.type != "cuda":
        raise _errors.invalid_argument("device", expected, repr(device))
    return parsed


def synchronize(device: Union[torch.device, str, int, None] = None) -> None:
    """Waits for the work queued on a CUDA device (default: the current one), like
    torch.cuda.synchronize, then raises InvalidArgumentError if a jagflash call on it found bad
    offsets in its device check (the default) and no later call has reported it yet: "did an
    earlier call fail?". The failure then counts as reported. Nothing to do without CUDA."""
    device = _cuda_device(device)
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return  # no CUDA call can have run
    lib = _lib.lib()
    with torch.cuda.device(device):
        torch.cuda.synchronize()
        _errors.check(lib.jagflash_synchronize(torch.cuda.current_stream().cuda_stream), lib)
