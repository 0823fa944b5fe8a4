#!/usr/bin/env python3
"""Dense SDPA ([B, H, S, D]) forward + backward through PyTorch's flash backend, PyTorch's own
kernel against jagflash activated in torch's flash-attention registry, for the layouts jagflash
reads in place (contiguous MHA, [B, S, H, D] memory seen through transpose(1, 2)) and the one it
copies (GQA on contiguous [B, H, S, D]): what the copy costs. One process, CUDA events around
several calls, medians.

    python bench/registry_dense.py        # on the GPU machine
"""
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, activate_flash_attention_impl, restore_flash_attention_impl, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
import jagflash  # noqa: E402,F401  (registers "jagflash")

B, S, H, D = 8, 2048, 16, 128


def inputs(layout, heads_kv, g):
    def make(heads):
        if layout == "bshd":  # [B, S, H, D] memory seen as [B, H, S, D]
            return torch.randn((B, S, heads, D), generator=g, device="cuda").to(torch.bfloat16).transpose(1, 2)
        return torch.randn((B, heads, S, D), generator=g, device="cuda").to(torch.bfloat16)
    return [t.requires_grad_() for t in (make(H), make(heads_kv), make(heads_kv))]


def time_step(q, k, v, dout, gqa, calls=5, rounds=9):
    def step():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        torch.autograd.grad(out, (q, k, v), dout)
    step()
    samples = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            step()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / calls)
    return statistics.median(samples)


def main():
    g = torch.Generator(device="cuda").manual_seed(3)
    print(f"B={B} S={S} H={H} D={D} bf16 causal, forward + backward a call (ms)")
    print("| layout | jagflash reads | PyTorch flash | jagflash | jagflash / PyTorch time |")
    print("|---|---|---|---|---|")
    for name, layout, heads_kv, how in (("[B,H,S,D] MHA", "bhsd", H, "in place"),
                                        ("[B,S,H,D] via transpose MHA", "bshd", H, "in place"),
                                        ("[B,S,H,D] via transpose GQA 16/4", "bshd", 4, "in place"),
                                        ("[B,H,S,D] GQA 16/4", "bhsd", 4, "a copy")):
        q, k, v = inputs(layout, heads_kv, g)
        dout = torch.randn(q.shape, generator=g, device="cuda").to(torch.bfloat16)
        gqa = heads_kv != H
        times = []
        for active in (False, True):
            if active:
                activate_flash_attention_impl("jagflash")
            try:
                times.append(time_step(q, k, v, dout, gqa))
            except Exception as e:  # noqa: BLE001 - a backend that cannot serve the case
                times.append(None)
                print(f"registry_dense.py: {name}, {'jagflash' if active else 'PyTorch'}: {type(e).__name__}: "
                      f"{str(e).splitlines()[0][:160]}")
        restore_flash_attention_impl()
        text = [f"{t:.3f}" if t is not None else "-" for t in times]
        ratio = f"{times[1] / times[0]:.2f}" if None not in times else "-"
        print(f"| {name} | {how} | {text[0]} | {text[1]} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
