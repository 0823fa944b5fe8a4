"""An allocation that does not fit raises torch's own torch.OutOfMemoryError (torch.cuda.
OutOfMemoryError on CUDA), saying what was asked for, as PyTorch's kernels do, so that a caller's
OOM handling (skip the batch, shrink it) works; it was a RuntimeError naming the binding's
aoti_torch_empty_strided call. Nothing of the caller's is written."""
import pytest
import torch

import jagflash
from conftest import needs_cuda

GIB = 2**30


def _huge_view(heads, head_dim):
    """q of 2^31 - 1 rows (the most int32 offsets address) seen through stride-0 views: a few
    bytes of memory, but the binding must copy it densely (the C API cannot read overlapping
    heads), and that copy (petabytes) cannot be allocated."""
    return torch.zeros(1, 1, head_dim, dtype=torch.bfloat16).expand(2**31 - 1, heads, head_dim)


def test_a_copy_that_does_not_fit_raises_torchs_out_of_memory_error():
    q = _huge_view(4096, 256)
    k = v = torch.zeros(1, 1, 256, dtype=torch.bfloat16)
    offsets = torch.tensor([0, 2**31 - 1], dtype=torch.int32)
    kv_offsets = torch.tensor([0, 1], dtype=torch.int32)
    size = (2**31 - 1) * 4096 * 256 * 2
    with pytest.raises(torch.OutOfMemoryError) as info:
        jagflash.jagged_attention(q, k, v, offsets, kv_offsets)
    assert str(info.value) == (f"jagflash: CPU out of memory. Tried to allocate {size / GIB:.2f} GiB ({size} bytes) "
                               f"for a dense copy of an input.")
    assert not isinstance(info.value, jagflash.JagflashError)  # torch's class, not a JagflashError


def test_the_binding_s_message_becomes_torchs_error_with_the_workspace_named():
    """The translation alone (the CUDA path's message, on any machine): the size asked for and
    what the backward's workspace holds."""
    from jagflash import _launch

    error = _launch.out_of_memory(f"out of memory: the backward's workspace, {3 * GIB}, bytes, on cpu")
    assert error is None  # not the binding's shape: left as it was
    error = _launch.out_of_memory(f"out of memory: the backward's workspace, {3 * GIB} bytes, on cpu")
    assert isinstance(error, torch.OutOfMemoryError)
    assert str(error) == (f"jagflash: CPU out of memory. Tried to allocate 3.00 GiB ({3 * GIB} bytes) for the "
                          f"backward's workspace (mostly the fp32 dQ accumulator, 4 * total_q * H * the kernel's "
                          f"head dim bytes).")


@needs_cuda
def test_a_backward_whose_workspace_does_not_fit_raises_torch_cuda_out_of_memory_error():
    """A D = 128 backward whose fp32 dQ accumulator (twice q's bf16 bytes) is given half the room
    it needs: torch.cuda.OutOfMemoryError naming the workspace and its size; q.grad stays None."""
    total, heads, head_dim = 1 << 20, 8, 128
    g = torch.Generator(device="cuda").manual_seed(5401)
    q, k, v = (torch.randn(total, heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
               .requires_grad_() for _ in range(3))
    offsets = torch.tensor([0, total // 2, total], dtype=torch.int32, device="cuda")
    out = jagflash.jagged_attention(q, k, v, offsets)
    dout = torch.ones_like(out)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, capacity = torch.cuda.mem_get_info()
    # dq, dk, dv (q's size each) fit; of the workspace (2 * q.nbytes and a little) about half does.
    budget = torch.cuda.memory_allocated() + 3 * q.nbytes + q.nbytes + 64 * 2**20
    torch.cuda.set_per_process_memory_fraction(budget / capacity)
    try:
        with pytest.raises(torch.cuda.OutOfMemoryError, match=r"^jagflash: CUDA out of memory\. Tried to allocate "
                                                              r"[0-9.]+ GiB \([0-9]+ bytes\) for the backward's "
                                                              r"workspace \(mostly the fp32 dQ accumulator"):
            out.backward(dout)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert q.grad is None and k.grad is None and v.grad is None
