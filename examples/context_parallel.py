"""jagflash under PyTorch's context parallelism: one long causal sequence split over the ranks.

torch.distributed.tensor.experimental.context_parallel shards the sequence over the ranks (with
head-tail load balancing: of 2W equal chunks, rank r holds chunks r and 2W-1-r), and replaces
F.scaled_dot_product_attention by a ring over the ranks' K/V whose steps are calls of
aten::_scaled_dot_product_flash_attention: q [B, H, S_local, D] against one rank's K/V, causal on
the diagonal step and unmasked (with half of q or half of K/V) on the others. Each step's out is
merged with its lse ([B, H, S_local] fp32, the layout PyTorch's flash kernel returns); the backward
calls aten::_scaled_dot_product_flash_attention_backward once per step with the merged out and lse
and sends dK/dV back round the ring. Those two ops are what jagflash serves once active in torch's
registry. CP in torch 2.11 splits dense SDPA only: a jagged batch (varlen_attn, nested tensors)
is not split by it.

    torchrun --nproc_per_node=2 examples/context_parallel.py          # 2 GPUs: check, then 128k tokens timed
    python examples/context_parallel.py                                # 1 GPU (a ring of one)
    torchrun --nproc_per_node=2 examples/context_parallel.py --device cpu   # gloo + the C++ reference

The model: pre-norm transformer blocks on random features [1, S, dim] (no embedding, no positions:
only the causal mask orders the tokens), MSE to a random target. Each rank's loss is the mean over
its tokens; the gradients are all-reduced (averaged) over the ranks as DDP or FSDP over the CP
mesh would do, which gives the gradient of the whole sequence's mean loss.

  check   (--check-seq-len tokens, each attention) the same model, same weights and data, run
          unsplit on every rank without context parallelism: the CP run's output (unsharded),
          loss and gradients must match it within the dtype's tolerance; with 2 ranks, a rank's
          gradient before the all-reduce must not (the check can fail).
  timing  (--seq-len tokens) training steps (forward, backward, gradient all-reduce, Adam) with
          jagflash and with PyTorch's own flash kernel under the same API, taken in turns; tokens/s
          per GPU = the rank's tokens over the median step time.

On CUDA the parameters are fp32 and the forward runs under bf16 autocast, with SDPA held to its
flash backend (sdpa_kernel), so every ring step is a flash op: jagflash's when active, PyTorch's
FlashAttention-2 after restore_flash_attention_impl(). On CPU, for the tests: PyTorch's SDPA calls
aten::_scaled_dot_product_flash_attention_for_cpu there, an op context parallelism has no
sharding rule for ("does not have a sharding strategy registered"), so the example stands in for
SDPA's CUDA branch with a function that calls aten::_scaled_dot_product_flash_attention, served by
jagflash's CPU kernels (jagflash.registry.register_kernels("CPU")). The CPU run makes the same op
calls as a GPU run, in fp32, on the float64 C++ reference, whose backward takes P and delta from
the merged out and lse it is given, as the GPU backwards do, so each ring step gets its block's
share of the gradient (python/tests/test_context_parallel.py checks that contract).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_ddp  # noqa: E402  (first: it sets the NVLS variables before torch is imported)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor.experimental import context_parallel  # noqa: E402
from torch.distributed.tensor.experimental._attention import context_parallel_unshard, set_rotate_method  # noqa: E402
from torch.nn.attention import SDPBackend, activate_flash_attention_impl, restore_flash_attention_impl  # noqa: E402
from torch.nn.attention import sdpa_kernel  # noqa: E402

import jagflash  # noqa: E402

# seq_len: the timed length; check_seq_len: the checked one, short enough for the unsplit
# reference to be cheap (on one GPU 128k fits too: flash attention keeps no S x S matrix).
GPU_DEFAULTS = dict(seq_len=131072, check_seq_len=16384, heads=8, head_dim=128, dim=1024, layers=2)
CPU_DEFAULTS = dict(seq_len=64, check_seq_len=48, heads=2, head_dim=64, dim=64, layers=1)
IMPLS = ("jagflash", "pytorch_flash")

# Relative (inf-norm) tolerances of the check. CUDA, bf16 autocast: every ring step rounds its out
# (and dq, dk, dv) to bf16 before the fp32 merge where the unsplit run rounds once, so the two runs
# differ by a few bf16 roundings (2^-8 relative each), carried through the layers to the output;
# the gradient tolerance is the GPU tests' bf16 one (python/tests/conftest.py). A CPU run of this
# check under bf16 autocast (jagflash's CPU forward, a float64 backward that reads the given out
# and lse; 512 and 2048 tokens, 2 ranks) gave 5.5e-3 to 6.4e-3 on the output, 2e-6 to 6e-6 on the
# loss and 5e-3 to 6e-3 on the gradients. CPU: fp32 with the float64 reference, where only the
# fp32 merge and summation order differ.
TOLERANCE = {"cuda": dict(output=2e-2, loss=1e-2, grad=2e-2), "cpu": dict(output=1e-5, loss=1e-5, grad=1e-5)}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available")
    parser.add_argument("--backend", choices=("nccl", "gloo"), default=None, help="default: nccl on cuda, gloo on cpu")
    parser.add_argument("--seq-len", type=int, default=None, help="timed sequence length (a multiple of 2 x ranks)")
    parser.add_argument("--check-seq-len", type=int, default=None,
                        help="checked sequence length (a multiple of 2 x ranks); 0 skips the check")
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--head-dim", type=int, default=None, help="64, 128 or 256")
    parser.add_argument("--dim", type=int, default=None, help="model width")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--attention", choices=IMPLS + ("both",), default=None,
                        help="what the check and the timing run (default: both on cuda; jagflash on cpu, where "
                             "PyTorch has no flash kernel)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round and implementation")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before each round's")
    parser.add_argument("--rounds", type=int, default=2, help="timing rounds (implementations alternate)")
    parser.add_argument("--rotate", choices=("allgather", "alltoall"), default="allgather",
                        help="how the ring exchanges K/V (torch's set_rotate_method)")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0, help="model init; the data uses seed + 1")
    parser.add_argument("--report-json", default=None, help="append one JSON line per result (rank 0)")
    args = parser.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.backend is None:
        args.backend = "nccl" if args.device == "cuda" else "gloo"
    for name, value in (GPU_DEFAULTS if args.device == "cuda" else CPU_DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.attention is None:
        args.attention = "both" if args.device == "cuda" else "jagflash"
    if args.device == "cpu" and args.attention != "jagflash":
        parser.error("PyTorch has no flash kernel on CPU: on cpu only --attention jagflash runs")
    return args


class Block(nn.Module):
    """Pre-norm transformer block over [B, S, dim]; attention is SDPA, causal."""

    def __init__(self, dim, heads, head_dim):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.attn_norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * heads * head_dim)
        self.out_proj = nn.Linear(heads * head_dim, dim)
        self.mlp_norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        batch, length, _ = x.shape
        qkv = self.qkv(self.attn_norm(x)).view(batch, length, 3, self.heads, self.head_dim)
        # [B, H, S, D] views of the [B, S, H, D] projection, the layout SDPA (and CP's seq dim 2)
        # expects; the registry reads q in place and context parallelism makes k and v contiguous.
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
        # Looked up at call time: context_parallel replaces F.scaled_dot_product_attention.
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out_proj(attn.transpose(1, 2).reshape(batch, length, -1))
        return x + self.mlp(self.mlp_norm(x))


class Model(nn.Module):
    def __init__(self, dim, heads, head_dim, layers):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, heads, head_dim) for _ in range(layers))
        self.head_norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, dim)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(self.head_norm(x))


def build_model(args, device):
    """The same initial weights on every rank (seeded)."""
    torch.manual_seed(args.seed)
    return Model(args.dim, args.heads, args.head_dim, args.layers).to(device)


def make_sequence(args, length, device):
    """features and target [1, length, dim], the same on every rank."""
    generator = torch.Generator().manual_seed(args.seed + 1)
    x = torch.randn(1, length, args.dim, generator=generator)
    target = torch.randn(1, length, args.dim, generator=generator)
    return x.to(device), target.to(device)


def _flash_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """SDPA's CUDA flash branch on any device: aten::_scaled_dot_product_flash_attention's out."""
    if attn_mask is not None or enable_gqa:
        raise NotImplementedError("the CPU stand-in for SDPA's flash branch takes no attn_mask and no enable_gqa")
    return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal,
                                                              scale=scale)[0]


# context_parallel patches torch.nn.functional by the name of the function it finds there.
_flash_sdpa.__name__ = "scaled_dot_product_attention"


@contextlib.contextmanager
def attention(impl, device):
    """SDPA served by impl ("jagflash" or "pytorch_flash") within the block.
    CUDA: torch's registry (jagflash active, or restored to PyTorch's kernel) and SDPA held to its
    flash backend, so it cannot pick another one. CPU: jagflash's kernels registered for CPU
    tensors and F.scaled_dot_product_attention swapped for _flash_sdpa (the module docstring says
    why); enter this before context_parallel, which wraps whatever F.scaled_dot_product_attention
    is on entry."""
    if device.type == "cuda":
        if impl == "jagflash":
            activate_flash_attention_impl("jagflash")
        else:
            restore_flash_attention_impl(_raise_warn=False)
        try:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                yield
        finally:
            restore_flash_attention_impl(_raise_warn=False)
        return
    assert impl == "jagflash", impl
    library = jagflash.registry.register_kernels("CPU")
    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _flash_sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
        library._destroy()


def forward_loss(model, x, target):
    with train_ddp.autocast(x.device):
        out = model(x)
    return out, F.mse_loss(out.float(), target)


def average_grads(model):
    """Each parameter's gradient averaged over the ranks, in place (gloo has no ReduceOp.AVG)."""
    world = dist.get_world_size()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world


def parameter_grads(model):
    return [p.grad.detach().clone() for p in model.parameters()]


def max_relative_diff(values, references):
    return max(((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()
               for a, b in zip(values, references))


def check_length(length, world, name):
    if length % (2 * world):
        raise SystemExit(f"{name} {length}: context parallelism's load balancing splits the sequence into "
                         f"2 x {world} equal chunks: use a multiple of {2 * world}")


def check(args, device, mesh, impl):
    """The CP run against the unsplit model (module docstring), both with impl. Returns one record
    per quantity."""
    world = dist.get_world_size()
    check_length(args.check_seq_len, world, "--check-seq-len")
    model = build_model(args, device)
    x, target = make_sequence(args, args.check_seq_len, device)
    with attention(impl, device):
        ref_out, ref_loss = forward_loss(model, x, target)
        ref_loss.backward()
        ref_grads = parameter_grads(model)
        model.zero_grad(set_to_none=True)
        # context_parallel shards its buffers in place: give it copies.
        x_cp, target_cp = x.clone(), target.clone()
        with context_parallel(mesh, buffers=[x_cp, target_cp], buffer_seq_dims=[1, 1],
                              no_restore_buffers={x_cp, target_cp}):
            out, loss = forward_loss(model, x_cp, target_cp)
            loss.backward()
    out = context_parallel_unshard(mesh, [out.detach().contiguous()], [1])[0]
    local_grads = parameter_grads(model)
    average_grads(model)
    loss = loss.detach().clone()
    dist.all_reduce(loss)
    loss /= world

    tolerance = TOLERANCE[device.type]
    out_tol, loss_tol, grad_tol = tolerance["output"], tolerance["loss"], tolerance["grad"]
    out_diff = max_relative_diff([out], [ref_out.detach()])
    loss_diff = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
    grad_diff = max_relative_diff(parameter_grads(model), ref_grads)
    grad_record = dict(check="cp grad", ok=grad_diff <= grad_tol, max_rel_diff=grad_diff, tolerance=grad_tol,
                       detail=f"max rel diff over parameters {grad_diff:.2e} (tol {grad_tol:.0e})")
    if world > 1:
        # Before the all-reduce a rank holds only its own tokens' share: the check must tell it apart.
        local_diff = max_relative_diff(local_grads, ref_grads)
        grad_record["ok"] = grad_record["ok"] and local_diff > grad_tol
        grad_record["local_rel_diff"] = local_diff
        grad_record["detail"] += f"; this rank's gradient before the all-reduce would give {local_diff:.2e}"
    return [
        dict(check="cp output", ok=out_diff <= out_tol, max_rel_diff=out_diff, tolerance=out_tol,
             detail=f"unsharded output max rel diff {out_diff:.2e} (tol {out_tol:.0e})"),
        dict(check="cp loss", ok=loss_diff <= loss_tol, rel_diff=loss_diff, tolerance=loss_tol,
             detail=f"loss {loss.item():.6f} vs unsplit {ref_loss.item():.6f}, rel diff {loss_diff:.2e} "
                    f"(tol {loss_tol:.0e})"),
        grad_record,
    ]


def timed_round(args, model, device, mesh, impl, x, target):
    """warmup + steps training steps under CP with impl. Returns the timed steps' seconds."""
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    seconds = []
    with attention(impl, device):
        x_cp, target_cp = x.clone(), target.clone()
        with context_parallel(mesh, buffers=[x_cp, target_cp], buffer_seq_dims=[1, 1],
                              no_restore_buffers={x_cp, target_cp}):
            for _ in range(args.warmup + args.steps):
                train_ddp.synchronize(device)
                start = time.perf_counter()
                optimizer.zero_grad(set_to_none=True)
                _, loss = forward_loss(model, x_cp, target_cp)
                loss.backward()
                average_grads(model)
                optimizer.step()
                train_ddp.synchronize(device)
                seconds.append(time.perf_counter() - start)
    if device.type == "cuda":
        jagflash.read_device_error()  # raises if a device-side offsets check failed
    return seconds[args.warmup:]


def timing(args, device, mesh):
    """Rounds of timed steps, the implementations in turns (the order reversed every other round).
    Returns {impl: (median seconds per step, tokens/s of this rank)}."""
    world = dist.get_world_size()
    check_length(args.seq_len, world, "--seq-len")
    impls = IMPLS if args.attention == "both" else (args.attention,)
    x, target = make_sequence(args, args.seq_len, device)
    models = {impl: build_model(args, device) for impl in impls}
    seconds = {impl: [] for impl in impls}
    for round_index in range(args.rounds):
        for impl in impls if round_index % 2 == 0 else impls[::-1]:
            seconds[impl] += timed_round(args, models[impl], device, mesh, impl, x, target)
    local_tokens = args.seq_len // world
    return {impl: (statistics.median(s), local_tokens / statistics.median(s)) for impl, s in seconds.items()}


def main(argv=None):
    args = parse_args(argv)
    device = train_ddp.setup_distributed(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    set_rotate_method(args.rotate)
    description = dict(
        script="context_parallel.py", world_size=world,
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", backend=args.backend,
        precision="bf16 autocast" if device.type == "cuda" else "fp32", heads=args.heads, head_dim=args.head_dim,
        dim=args.dim, layers=args.layers, rotate=args.rotate,
        nvls_env={k: os.environ.get(k) for k in train_ddp.NVLS_OFF},
    )
    if rank == 0:
        print(f"== context_parallel: {world} rank(s), {description['device']}, {args.backend}, H={args.heads} "
              f"D={args.head_dim} dim={args.dim} layers={args.layers}, ring exchange {args.rotate}")
    failed = False
    impls = IMPLS if args.attention == "both" else (args.attention,)
    for impl in impls if args.check_seq_len else ():
        results = check(args, device, mesh, impl)
        all_results = train_ddp.gather(results)
        for i, result in enumerate(results):
            per_rank = [rank_results[i] for rank_results in all_results]
            ok = all(r["ok"] for r in per_rank)
            failed |= not ok
            if rank == 0:
                print(f"{'PASS' if ok else 'FAIL'}  {result['check']:<10} {impl:<14} {args.check_seq_len} tokens, "
                      f"rank 0: {result['detail']}")
            record = dict(kind="check", attention=impl, seq_len=args.check_seq_len, **description)
            record.update(result, ok=ok, detail_per_rank=[r["detail"] for r in per_rank])
            train_ddp.write_report(args.report_json, record)
    if args.steps > 0:
        measured = timing(args, device, mesh)
        rates = train_ddp.gather({impl: rate for impl, (_, rate) in measured.items()})
        for impl, (step_s, _) in measured.items():
            per_rank = [r[impl] for r in rates]
            if rank == 0:
                print(f"      {impl:<14} {args.seq_len} tokens ({args.seq_len // world} per rank): median step "
                      f"{step_s * 1e3:.1f} ms (rank 0), tokens/s per GPU {[round(r) for r in per_rank]}")
            train_ddp.write_report(args.report_json, dict(
                kind="train", attention=impl, seq_len=args.seq_len, steps=args.steps * args.rounds,
                step_s_rank0=step_s, tokens_per_rank=args.seq_len // world, tokens_per_s_per_rank=per_rank,
                **description))
        if rank == 0 and len(measured) == 2:
            ratio = measured["jagflash"][1] / measured["pytorch_flash"][1]
            print(f"      jagflash / pytorch_flash tokens/s (rank 0): {ratio:.3f}")
    if rank == 0:
        print("== " + ("FAILED" if failed else "done"))
    train_ddp.shutdown()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
