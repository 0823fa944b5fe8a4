"""jagflash under PyTorch's context parallelism (torch.distributed.tensor.experimental.
context_parallel), on the CPU: examples/context_parallel.py with gloo on 2 processes and in one,
and the flash-op contract that CP's ring relies on.

CP's ring backward calls aten::_scaled_dot_product_flash_attention_backward once per K/V block
with the out and lse of the whole row (merged over every block), and expects that block's share
of the gradient: P_ij = exp(s_ij - lse_i) and delta_i = rowsum(dO_i * O_i) from what it is given.
Every backward here honours it: the GPU paths (the Hopper backward and the oracle) and the C++
reference, which serves CPU tensors, take P from the given lse and delta from the given out."""
import math

import pytest
import torch

from conftest import needs_cuda
from test_distributed_cpu import by_check, run_script

from jagflash import registry


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One run of the example on 2 processes: the check, and one timed step."""
    return run_script("context_parallel.py", ["--steps", "1", "--warmup", "0", "--rounds", "1"], 2,
                      tmp_path_factory.mktemp("cp2"))


def test_cp_output_and_loss_equal_the_unsplit_model_on_two_ranks(two_ranks):
    _, output, records = two_ranks
    checks = by_check(records)
    assert {"cp output", "cp loss", "cp grad"} <= set(checks), output[-4000:]
    for name in ("cp output", "cp loss"):
        assert checks[name]["world_size"] == 2
        assert checks[name]["ok"], f"{name}: {checks[name]['detail_per_rank']}"


def test_cp_gradients_equal_the_unsplit_model_on_two_ranks(two_ranks):
    _, output, records = two_ranks
    grad = by_check(records)["cp grad"]
    assert grad["ok"], grad["detail_per_rank"]


def test_cp_training_step_ran_on_two_ranks(two_ranks):
    _, output, records = two_ranks
    (train,) = [r for r in records if r["kind"] == "train"]
    assert train["attention"] == "jagflash" and train["tokens_per_rank"] * 2 == train["seq_len"]
    assert len(train["tokens_per_s_per_rank"]) == 2 and min(train["tokens_per_s_per_rank"]) > 0


def test_cp_in_one_process_equals_the_unsplit_model(tmp_path):
    """World size 1: a ring of one step, whose out and lse are the block's own; every check
    holds."""
    rc, output, records = run_script("context_parallel.py", ["--steps", "1", "--warmup", "0", "--rounds", "1"], 1,
                                     tmp_path)
    assert rc == 0, output[-4000:]
    checks = by_check(records)
    assert set(checks) == {"cp output", "cp loss", "cp grad"}, output[-4000:]
    assert all(c["ok"] for c in checks.values()), [c["detail"] for c in checks.values()]


# --- the contract, in one process -----------------------------------------------------------------


@pytest.fixture
def kernels(request):
    """jagflash serving the flash ops on the test's device: registered for CPU tensors, or active
    in torch's registry on CUDA."""
    if request.param == "cpu":
        library = registry.register_kernels("CPU")
        yield torch.device("cpu"), torch.float32
        library._destroy()
    else:
        torch.nn.attention.restore_flash_attention_impl(_raise_warn=False)
        torch.nn.attention.activate_flash_attention_impl("jagflash")
        yield torch.device("cuda"), torch.bfloat16
        torch.nn.attention.restore_flash_attention_impl(_raise_warn=False)


@pytest.mark.parametrize("kernels", [
    pytest.param("cpu"),
    pytest.param("cuda", marks=needs_cuda),
], indirect=True)
@pytest.mark.parametrize("seed", [0, 1])
def test_flash_backward_per_kv_block_with_the_rows_out_and_lse(kernels, seed):
    """What each step of CP's ring backward computes: the backward over one K/V block, given the
    out and lse of the whole row. The blocks' dq summed and their dk, dv put side by side must be
    the gradients of attention over all the keys (against float64 autograd)."""
    device, dtype = kernels
    generator = torch.Generator().manual_seed(seed)
    heads, len_q, head_dim, blocks = 2, 37, 64, (17, 1, 30)  # awkward block lengths, q != kv
    len_kv = sum(blocks)
    q = torch.randn(1, heads, len_q, head_dim, generator=generator)
    k, v = (torch.randn(1, heads, len_kv, head_dim, generator=generator) for _ in range(2))
    dout = torch.randn(1, heads, len_q, head_dim, generator=generator)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref_out = torch.softmax(q64 @ k64.transpose(-1, -2) / math.sqrt(head_dim), -1) @ v64
    ref_dq, ref_dk, ref_dv = torch.autograd.grad(ref_out, (q64, k64, v64), dout.double())

    q, k, v, dout = (t.to(device, dtype) for t in (q, k, v, dout))
    aten = torch.ops.aten
    out, lse, _, _, _, _, rng_state, unused, _ = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False)
    dq = torch.zeros(q.shape, dtype=torch.float64)
    dks, dvs = [], []
    for k_block, v_block in zip(k.split(blocks, dim=2), v.split(blocks, dim=2)):
        dq_i, dk_i, dv_i = aten._scaled_dot_product_flash_attention_backward(
            dout, q, k_block, v_block, out, lse, None, None, len_q, k_block.size(2), 0.0, False, rng_state, unused)
        dq += dq_i.double().cpu()
        dks.append(dk_i.double().cpu())
        dvs.append(dv_i.double().cpu())
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for name, got, want in (("dq", dq, ref_dq), ("dk", torch.cat(dks, 2), ref_dk), ("dv", torch.cat(dvs, 2), ref_dv)):
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert err <= tolerance, f"{name}: max rel err {err:.2e} > {tolerance:.0e} (seed {seed})"
