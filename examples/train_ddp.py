"""jagflash inside PyTorch distributed training: a small model trained with DDP or FSDP2.

Every block runs jagflash.jagged_attention (causal) on a jagged batch: rank r takes its own slice
of the shared generator's "gemskew" lengths and its own random token features, so each rank
trains on a different batch. The model has no embedding: the inputs are random features
[total_tokens, dim] and the loss is the MSE to a fixed random target, which the model can fit,
so the loss falls within a few steps.

    torchrun --nproc_per_node=2 examples/train_ddp.py --mode ddp      # 2 GPUs, NCCL, bf16
    torchrun --nproc_per_node=2 examples/train_ddp.py --mode fsdp2
    python examples/train_ddp.py                                       # one process, one GPU
    python examples/train_ddp.py --attention varlen_attn               # the same with PyTorch's FA2 kernel
    torchrun --nproc_per_node=2 examples/train_ddp.py --device cpu     # gloo + the C++ reference

examples/test_train_ddp.py takes the same options and checks that the gradients after one step
equal a single process's over the same data (same seed), for DDP and FSDP2.

On CUDA the parameters are fp32 and the forward runs under bf16 autocast, so attention gets bf16
q/k/v (the Hopper kernels); on CPU everything is fp32 and attention runs the float64 C++
reference, so the CPU defaults are tiny. PyTorch has no CPU kernel for varlen_attn's op
(aten::_flash_attention_forward / _backward), so on CPU `--attention varlen_attn` runs that op on
jagflash's CPU kernels (jagflash.registry.register_kernels("CPU")): the peer's call and its DDP /
FSDP2 wrapping are exercised by the CPU tests, its CPU tokens/s are the C++ reference's. With
jagflash from a source checkout: PYTHONPATH=python JAGFLASH_LIBRARY=build/libjagflash.so.

NVLink multicast (NVLS) stays off, as our multi-GPU machines require: NCCL, torch's symmetric
memory and NVSHMEM each have their own switch. The three are set below before torch is imported,
so every library reads them at init; torchrun's workers inherit them from the launching shell
(scripts/gpu-ddp.sh exports them), and a value the caller set explicitly is kept — and then
reported by examples/test_train_ddp.py, which fails unless all three are off.
"""
import os

NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
for _name, _value in NVLS_OFF.items():
    os.environ.setdefault(_name, _value)

import argparse  # noqa: E402  (after the environment, on purpose)
import contextlib  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import socket  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

import jagflash  # noqa: E402

# Defaults per device: on the GPU the default batch (24 gemskew sequences, 14,246 tokens) is small
# enough for a per-call-overhead-bound step, --batch-sequences 256 (115,909 tokens) a kernel-bound
# one (bench/RESULTS.md, section 14); the CPU reference is float64 and single-threaded, so there
# the lengths are divided by 32 and the model is one narrow block.
GPU_DEFAULTS = dict(heads=8, head_dim=128, dim=1024, layers=2, batch_sequences=24, length_divisor=1)
CPU_DEFAULTS = dict(heads=2, head_dim=64, dim=64, layers=1, batch_sequences=4, length_divisor=32)


def add_arguments(parser):
    """The options shared by this example and examples/test_train_ddp.py (None = per device)."""
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="default: cuda when available")
    parser.add_argument("--backend", choices=("nccl", "gloo"), default=None,
                        help="default: nccl on cuda, gloo on cpu")
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--head-dim", type=int, default=None, help="64, 128 or 256")
    parser.add_argument("--dim", type=int, default=None, help="model width")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--batch-sequences", type=int, default=None,
                        help="sequences per rank: rank r takes gemskew lengths [r*N, (r+1)*N)")
    parser.add_argument("--length-divisor", type=int, default=None,
                        help="each length is divided by this (at least 1 token stays)")
    parser.add_argument("--attention", choices=("jagflash", "varlen_attn"), default="jagflash",
                        help="varlen_attn: torch.nn.attention.varlen.varlen_attn (PyTorch's FlashAttention-2 "
                             "kernel on CUDA), the same model for a side-by-side tokens/s")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0, help="model init; rank r's features use seed + 1 + r")
    parser.add_argument("--report-json", default=None, help="append one JSON line per result (rank 0)")


def resolve_defaults(args):
    """Fills the options left at None with the device's defaults."""
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.backend is None:
        args.backend = "nccl" if args.device == "cuda" else "gloo"
    defaults = GPU_DEFAULTS if args.device == "cuda" else CPU_DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def setup_distributed(args):
    """init_process_group under torchrun, or as a world of one when started with plain python.
    Returns this rank's device."""
    if "RANK" not in os.environ:
        with socket.socket() as s:  # a free port, so a lone run never collides with another job
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    local_rank = int(os.environ["LOCAL_RANK"])
    if args.device == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)  # before init, so NCCL binds each rank to its own GPU
    else:
        device = torch.device("cpu")
    dist.init_process_group(args.backend)
    serve_varlen_attn_on_cpu(args, device)
    return device


_cpu_kernels = None  # the Library holding jagflash's CPU kernels, kept for the process's life


def serve_varlen_attn_on_cpu(args, device):
    """On CPU, registers jagflash's kernels for the flash ops varlen_attn calls (PyTorch has none
    there), so `--attention varlen_attn` runs: the C++ reference under the peer's code path."""
    global _cpu_kernels
    if device.type == "cpu" and getattr(args, "attention", "jagflash") == "varlen_attn" and _cpu_kernels is None:
        _cpu_kernels = jagflash.registry.register_kernels("CPU")


@dataclass
class JaggedBatch:
    x: torch.Tensor  # [total_tokens, dim] fp32 features
    target: torch.Tensor  # [total_tokens, dim] fp32
    offsets: torch.Tensor  # int32 [B+1]
    lengths: list


def make_batch(args, rank, device):
    """Rank `rank`'s batch: a deterministic function of (args, rank), so any process can rebuild
    any rank's batch (the gradient test builds them all)."""
    gemskew = jagflash.generate_lengths("gemskew")
    n = args.batch_sequences
    lengths = [max(1, gemskew[(rank * n + i) % len(gemskew)] // args.length_divisor) for i in range(n)]
    offsets = torch.zeros(n + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0)
    generator = torch.Generator().manual_seed(args.seed + 1 + rank)
    total = int(offsets[-1])
    x = torch.randn(total, args.dim, generator=generator)
    target = torch.randn(total, args.dim, generator=generator)
    return JaggedBatch(x.to(device), target.to(device), offsets.to(device), lengths)


class JaggedBlock(nn.Module):
    """Pre-norm transformer block; attention mixes tokens only within each sequence."""

    def __init__(self, dim, heads, head_dim, attention="jagflash"):
        super().__init__()
        self.heads, self.head_dim, self.attention = heads, head_dim, attention
        self.attn_norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * heads * head_dim)
        self.out_proj = nn.Linear(heads * head_dim, dim)
        self.mlp_norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, offsets, max_len=None):
        # [total, 3, H, D]: q, k and v are strided views of one projection; jagflash reads them
        # in place.
        qkv = self.qkv(self.attn_norm(x)).unflatten(1, (3, self.heads, self.head_dim))
        q, k, v = qkv.unbind(1)
        # "device": the offsets are checked by a small kernel instead of a copy to the host, so
        # the step has no host sync per attention call; main() reads the flag once at the end.
        check = "device" if x.is_cuda else "host"
        if self.attention == "varlen_attn":  # the peer: needs the longest length on the host
            from torch.nn.attention.varlen import varlen_attn

            if max_len is None:
                max_len = int((offsets[1:] - offsets[:-1]).max())
            attn = varlen_attn(q, k, v, offsets, offsets, max_len, max_len, window_size=(-1, 0))
        else:
            attn = jagflash.jagged_attention(q, k, v, offsets, causal=True, check_offsets=check)
        x = x + self.out_proj(attn.flatten(1))
        return x + self.mlp(self.mlp_norm(x))


class JaggedModel(nn.Module):
    def __init__(self, dim, heads, head_dim, layers, attention="jagflash"):
        super().__init__()
        self.blocks = nn.ModuleList(JaggedBlock(dim, heads, head_dim, attention) for _ in range(layers))
        self.head_norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, dim)

    def forward(self, x, offsets, max_len=None):
        for block in self.blocks:
            x = block(x, offsets, max_len)
        return self.head(self.head_norm(x))


def build_model(args, device):
    """The same initial weights on every rank (seeded), as DDP and the gradient test expect."""
    torch.manual_seed(args.seed)
    attention = getattr(args, "attention", "jagflash")
    return JaggedModel(args.dim, args.heads, args.head_dim, args.layers, attention).to(device)


def wrap(model, mode, device):
    """DDP, or FSDP2 with each block its own shard group (the model is changed in place)."""
    if mode == "ddp":
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def autocast(device):
    """bf16 autocast on CUDA: fp32 master weights, bf16 matmuls and attention. fp32 on CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def batch_loss(model, batch):
    with autocast(batch.x.device):
        out = model(batch.x, batch.offsets, max(batch.lengths))
    return F.mse_loss(out.float(), batch.target)


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(model, batch, steps, lr, warmup_steps=2):
    """Adam on this rank's batch for `steps` steps. Returns the loss of every step averaged over
    ranks (the objective DDP and FSDP2 optimise) and this rank's tokens/s over the steps after
    the warm-up (the first steps pay for NCCL setup and DDP's bucket rebuild)."""
    device = batch.x.device
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    synchronize(device)
    start = time.perf_counter()
    for step in range(steps):
        if step == warmup_steps:
            synchronize(device)
            start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = batch_loss(model, batch)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    synchronize(device)
    timed_steps = steps - warmup_steps if steps > warmup_steps else steps
    seconds = time.perf_counter() - start
    # One all-reduce after the loop rather than one per step, so the timing holds no extra sync.
    global_losses = torch.stack(losses)
    dist.all_reduce(global_losses)
    global_losses /= dist.get_world_size()
    if device.type == "cuda":
        jagflash.read_device_error()  # raises if the device-side offsets check ever failed
    return global_losses.tolist(), len(batch.x) * timed_steps / seconds


def gather(value):
    """value from every rank, in rank order."""
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def run_description(args, device):
    """The fields every JSON report line shares."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return dict(
        world_size=dist.get_world_size(), device=name, backend=args.backend,
        precision="bf16 autocast" if device.type == "cuda" else "fp32", heads=args.heads,
        attention=getattr(args, "attention", "jagflash") + (
            " (on jagflash's CPU kernels)" if device.type == "cpu" and getattr(args, "attention", "") == "varlen_attn"
            else ""),
        head_dim=args.head_dim, dim=args.dim, layers=args.layers, batch_sequences=args.batch_sequences,
        length_divisor=args.length_divisor, nvls_env={k: os.environ.get(k) for k in NVLS_OFF},
    )


def shutdown():
    """destroy_process_group with no DDP/FSDP2 model left alive: call it after the models are
    gone. Gloo's process group joins its worker threads when its last reference drops. Were that
    reference a DDP reducer's, the join would run inside the model's teardown, holding the GIL,
    while a worker may still need the GIL to free a finished collective's tensors: the process
    hangs, or aborts at interpreter exit (figures: bench/NOTES.md, "Figures moved out of code
    comments"). Collected here
    first, the models leave the last reference to destroy_process_group, whose destructor
    releases the GIL."""
    gc.collect()  # DDP and FSDP2 modules sit in reference cycles: free them now, not at exit
    dist.destroy_process_group()


def write_report(path, record):
    """Appends one JSON line (rank 0 only)."""
    if path and dist.get_rank() == 0:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=("ddp", "fsdp2"), default="ddp")
    parser.add_argument("--steps", type=int, default=20)
    add_arguments(parser)
    args = resolve_defaults(parser.parse_args())
    device = setup_distributed(args)
    rank = dist.get_rank()
    batch = make_batch(args, rank, device)
    model = wrap(build_model(args, device), args.mode, device)
    losses, tokens_per_s = train(model, batch, args.steps, args.lr)
    tokens = gather(len(batch.x))
    rates = gather(tokens_per_s)
    if rank == 0:
        for step, loss in enumerate(losses):
            print(f"step {step:3d}  loss {loss:.5f}")
        print(f"{args.mode}: {dist.get_world_size()} rank(s) on {device.type}, tokens per rank {tokens}, "
              f"tokens/s per rank {[round(r) for r in rates]}")
    write_report(args.report_json, dict(
        kind="train", script="train_ddp.py", mode=args.mode, steps=args.steps, loss_first=losses[0],
        loss_last=losses[-1], tokens_per_rank=tokens, tokens_per_s_per_rank=rates, **run_description(args, device),
    ))
    del model, batch
    shutdown()


if __name__ == "__main__":
    main()
