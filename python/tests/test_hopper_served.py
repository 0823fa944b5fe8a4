"""The GPU tests' question "does this build's Hopper kernels serve the call" (conftest's
hopper_kernel_head_dim, hopper_unserved, skip_unless_hopper_serves), asked of the C library with no
device: fp32 never is, a served head dim names a kernel at or above it, and an unserved call is
skipped with a reason that names it and the build options that decide it."""
import pytest
import torch

from conftest import hopper_kernel_head_dim, hopper_unserved, skip_unless_hopper_serves

KERNEL_HEAD_DIMS = (64, 96, 128, 192, 256)


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [8, 64, 80, 128, 160, 200, 256])
def test_a_served_head_dim_names_a_kernel_at_or_above_it(head_dim, dtype, backward):
    kernel = hopper_kernel_head_dim(dtype, head_dim, backward=backward)
    assert kernel == 0 or (kernel in KERNEL_HEAD_DIMS and kernel >= head_dim), kernel
    assert (hopper_unserved(dtype, head_dim, forward=not backward, backward=backward) is None) == (kernel != 0)


def test_what_no_hopper_kernel_serves():
    assert hopper_kernel_head_dim(torch.float32, 128) == 0
    assert hopper_kernel_head_dim(torch.bfloat16, 264) == 0  # past every kernel


def test_an_unserved_call_is_skipped_with_its_reason():
    why = hopper_unserved(torch.float32, 128, 64, backward=True, score_mod="softcap", block_mask=True)
    assert why == ("fp32/128 (v 64) softcap block mask: this build instantiates no Hopper forward and backward for "
                   "it (JAGFLASH_HOPPER_DTYPES, JAGFLASH_HEAD_DIMS, JAGFLASH_FORWARD_HEAD_DIMS, "
                   "JAGFLASH_BACKWARD_HEAD_DIMS)")
    with pytest.raises(pytest.skip.Exception, match=r"^fp32/128: this build instantiates no Hopper forward for"):
        skip_unless_hopper_serves(torch.float32, 128)
