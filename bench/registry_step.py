#!/usr/bin/env python3
"""One training step of a small transformer block whose attention is PyTorch's
torch.nn.attention.varlen.varlen_attn, with PyTorch's own flash kernel and with jagflash activated
through torch.nn.attention's registry (the one-line switch), in one process on the same batch.

The block (pre-norm): x + proj(varlen_attn(qkv(LN(x)))), then + fc2(gelu(fc1(LN(x)))), bf16,
d_model = heads * head_dim, MLP 4 x d_model. A step is forward, backward of sum(y * dy) and an SGD
update. The batch is a jagflash.generate_lengths distribution (gemskew by default: 256 log-normal
lengths around 300, 116k tokens), self-attention, varlen_attn given the true maximum length.

Variants, timed in turns (one step each per round, the order reversed every other round, as
compare.py does: clock and power carry over from one measurement to the next):
  pytorch                 restore_flash_attention_impl(): aten's FlashAttention-2 kernels
  jagflash                activate_flash_attention_impl("jagflash"), offsets checked as
                          jagflash's default ("auto": on the host, two syncs per call)
  jagflash, device check  the same with jagflash.set_check_offsets("device") (no sync)
Each sample is one step between two CUDA events after a synchronize, medians over --iters rounds
after --warmup. Also timed the same way: the attention alone (varlen_attn forward + backward on the
block's q, k, v shapes). Last, the gradients of one step from the same weights under pytorch and
jagflash are compared (normalised max difference; bf16 noise is ~1e-2).

    python bench/registry_step.py                         # on the GPU (H100/H200)
    python bench/registry_step.py --device cpu --scale 64 # smoke test: jagflash on the CPU reference

On the CPU aten has no flash kernel, so the pytorch rows say so and jagflash's kernels are
registered for CPU tensors instead of activated (fp32, 2 heads of 64 by default, a few rounds).
"""
import argparse
import copy
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import activate_flash_attention_impl, restore_flash_attention_impl
from torch.nn.attention.varlen import varlen_attn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "python"))
import jagflash  # noqa: E402
from jagflash import registry  # noqa: E402

VARIANTS = ("pytorch", "jagflash", "jagflash, device check")
MASKS = {"none": (-1, -1), "causal": (-1, 0)}


class Block(torch.nn.Module):
    def __init__(self, heads, head_dim, mlp_ratio):
        super().__init__()
        dim = heads * head_dim
        self.heads, self.head_dim = heads, head_dim
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.proj = torch.nn.Linear(dim, dim, bias=False)
        self.fc1 = torch.nn.Linear(dim, mlp_ratio * dim)
        self.fc2 = torch.nn.Linear(mlp_ratio * dim, dim)

    def forward(self, x, offsets, max_len, window):
        tokens = x.size(0)
        q, k, v = self.qkv(self.norm1(x)).view(tokens, 3, self.heads, self.head_dim).unbind(1)
        attn = varlen_attn(q, k, v, offsets, offsets, max_len, max_len, window_size=window)
        x = x + self.proj(attn.reshape(tokens, -1))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class Variant:
    """Puts one variant in place for a sample and takes it out after (the registry, the offsets
    check). On the CPU, jagflash's kernels are registered for the CPU key (activation only
    registers them for CUDA, and aten has no CPU flash kernel)."""

    def __init__(self, name, device):
        self.name, self.device = name, device
        self.cpu_library = None

    def available(self):
        if self.name == "pytorch" and self.device.type != "cuda":
            return "aten::_flash_attention_forward has no CPU kernel"
        return None

    def __enter__(self):
        restore_flash_attention_impl(_raise_warn=False)
        if self.name != "pytorch":
            if self.device.type == "cuda":
                activate_flash_attention_impl("jagflash")
            else:
                self.cpu_library = registry.register_kernels("CPU")
            jagflash.set_check_offsets("device" if self.name.endswith("device check") else "auto")
        return self

    def __exit__(self, *exc):
        restore_flash_attention_impl(_raise_warn=False)
        if self.cpu_library is not None:
            self.cpu_library._destroy()
            self.cpu_library = None
        jagflash.set_check_offsets("auto")


def timed_ms(fn, device):
    """One call of fn between two events (CUDA) or perf_counter stamps (CPU), after a sync."""
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def interleaved_medians(fns, variants, device, warmup, iters):
    """{variant name: median ms} of fns[name]() timed in turns, reversed every other round."""
    names = [v.name for v in variants]
    for variant in variants:
        with variant:
            for _ in range(warmup):
                fns[variant.name]()
    times = {name: [] for name in names}
    for r in range(iters):
        for variant in variants if r % 2 == 0 else list(reversed(variants)):
            with variant:
                times[variant.name].append(timed_ms(fns[variant.name], device))
    return {name: statistics.median(samples) for name, samples in times.items()}


def normalised_difference(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def git_commit():
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dist", default="gemskew", choices=jagflash.DISTRIBUTIONS)
    p.add_argument("--seed", type=int, default=jagflash.DEFAULT_SEED)
    p.add_argument("--scale", type=int, default=1, help="divide every length by this (at least 1 token each)")
    p.add_argument("--heads", type=int, default=None, help="default 16 (CUDA), 2 (CPU)")
    p.add_argument("--head-dim", type=int, default=None, choices=[64, 128, 256], help="default 128 (CUDA), 64 (CPU)")
    p.add_argument("--mlp-ratio", type=int, default=4)
    p.add_argument("--masks", nargs="+", default=["none", "causal"], choices=list(MASKS))
    p.add_argument("--warmup", type=int, default=None, help="default 3 (CUDA), 1 (CPU)")
    p.add_argument("--iters", type=int, default=None, help="rounds; default 20 (CUDA), 3 (CPU)")
    args = p.parse_args()

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("registry_step.py: no CUDA device (use --device cpu --scale 64 for a smoke test)")
    on_gpu = device.type == "cuda"
    heads = args.heads or (16 if on_gpu else 2)
    head_dim = args.head_dim or (128 if on_gpu else 64)
    warmup = args.warmup if args.warmup is not None else (3 if on_gpu else 1)
    iters = args.iters if args.iters is not None else (20 if on_gpu else 3)
    dtype = torch.bfloat16 if on_gpu else torch.float32

    lengths = jagflash.generate_lengths(args.dist, args.seed)
    if args.scale > 1:
        lengths = [max(1, n // args.scale) for n in lengths]
    offsets = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    tokens, max_len = sum(lengths), max(lengths)
    dim = heads * head_dim

    torch.manual_seed(args.seed)
    block = Block(heads, head_dim, args.mlp_ratio).to(device=device, dtype=dtype)
    initial = copy.deepcopy(block.state_dict())
    optimizer = torch.optim.SGD(block.parameters(), lr=1e-6)
    x = torch.randn(tokens, dim, device=device, dtype=dtype)
    dy = torch.randn(tokens, dim, device=device, dtype=dtype)
    q, k, v = (torch.randn(tokens, heads, head_dim, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    dout = torch.randn(tokens, heads, head_dim, device=device, dtype=dtype)

    device_name = torch.cuda.get_device_name(device) if on_gpu else "CPU"
    print(f"registry_step.py: {device_name}, torch {torch.__version__}, jagflash {git_commit()}; {args.dist} "
          f"(scale {args.scale}): B = {len(lengths)}, {tokens} tokens, max length {max_len}; block d_model {dim} "
          f"({heads} heads x {head_dim}), MLP {args.mlp_ratio}x, {str(dtype).replace('torch.', '')}; "
          f"medians of {iters} rounds after {warmup} warm-up")

    variants = [Variant(name, device) for name in VARIANTS]
    for variant in variants:
        if variant.available() is not None:
            print(f"registry_step.py: {variant.name} skipped: {variant.available()}")
    runnable = [variant for variant in variants if variant.available() is None]

    rows = []
    for mask in args.masks:
        window = MASKS[mask]

        def step():
            optimizer.zero_grad(set_to_none=True)
            block(x, offsets, max_len, window).backward(dy)
            optimizer.step()

        def attention():
            out = varlen_attn(q, k, v, offsets, offsets, max_len, max_len, window_size=window)
            torch.autograd.grad(out, (q, k, v), dout)

        step_ms = interleaved_medians({v.name: step for v in runnable}, runnable, device, warmup, iters)
        attn_ms = interleaved_medians({v.name: attention for v in runnable}, runnable, device, warmup, iters)

        # The same weights, one forward + backward each: how far apart the gradients are.
        grads = {}
        for variant in runnable:
            block.load_state_dict(initial)
            with variant:
                block.zero_grad(set_to_none=True)
                block(x, offsets, max_len, window).backward(dy)
            grads[variant.name] = [p.grad.detach().clone() for p in block.parameters()]
        block.load_state_dict(initial)
        baseline = "pytorch" if "pytorch" in grads else None
        for variant in runnable:
            diff = (max(normalised_difference(a, b) for a, b in zip(grads[variant.name], grads[baseline]))
                    if baseline else float("nan"))
            base_step = step_ms.get("pytorch")
            base_attn = attn_ms.get("pytorch")
            rows.append((mask, variant.name, step_ms[variant.name],
                         base_step / step_ms[variant.name] if base_step else float("nan"),
                         tokens / step_ms[variant.name] / 1e3, attn_ms[variant.name],
                         base_attn / attn_ms[variant.name] if base_attn else float("nan"), diff))

    print()
    print("| mask | attention | step ms | step speedup | Mtokens/s | attention fwd+bwd ms | attention speedup | "
          "grad diff vs pytorch |")
    print("|---|---|---|---|---|---|---|---|")
    def number(value, spec):
        return "-" if value != value else format(value, spec)  # NaN: no pytorch row to compare with

    for mask, name, ms, speedup, mtok, attn, attn_speedup, diff in rows:
        print(f"| {mask} | {name} | {ms:.2f} | {number(speedup, '.3f')} | {mtok:.3f} | {attn:.2f} | "
              f"{number(attn_speedup, '.3f')} | {number(diff, '.2e')} |")


if __name__ == "__main__":
    main()
