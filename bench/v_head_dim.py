"""A v head dim of its own (Dv < D) on the GPU: jagflash at (D, Dv) against jagflash at (D, D) and
FA2 varlen at (D, D) (PyTorch's _flash_attention_forward / _backward take one head dim for q, k
and v, so a caller with a narrower v pads it to D: the peer's cost for the same call), forward and
backward, on the five distributions.

    python bench/v_head_dim.py [--dists ...] [--pairs 128:64 64:32 192:128] [--masks none causal] [--out DIR]

Each case draws q, k from N(0, 1) [T, H, D] and v, dout [T, H, Dv] in bf16 (the (D, D) calls take v
and dout zero-padded to D, so all three compute the same attention) and times the three in turns
(compare.measure_interleaved: medians of CUDA-event samples). Before timing, jagflash's (D, Dv)
output is checked against FA2's first Dv columns (max |difference| / max |FA2's|; over 5e-2 the
case is reported wrong and its ratios left out). Writes v_head_dim.json and prints a table last.
"""
import argparse
import functools
import json
import os
import pathlib
import sys

import torch
import torch.nn.functional as F

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import compare  # noqa: E402
import peers  # noqa: E402

import jagflash  # noqa: E402

WRONG = 5e-2


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", str(HERE / "out")))
    p.add_argument("--dists", nargs="+", default=list(jagflash.DISTRIBUTIONS))
    p.add_argument("--pairs", nargs="+", default=["128:64", "64:32", "192:128"],
                   help="D:Dv pairs (192:128: the backward is refused, forward only)")
    p.add_argument("--masks", nargs="+", default=["none", "causal"], choices=["none", "causal"])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--fwd-calls", type=int, default=4)
    p.add_argument("--bwd-calls", type=int, default=2)
    p.add_argument("--budget-s", type=float, default=1.0)
    return p.parse_args(argv)


def ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def fmt(v, spec="{:.2f}"):
    return "-" if v is None else spec.format(v)


def run_case(q, k, v, dout, offsets, lengths, causal, args, device):
    d, dv = q.shape[-1], v.shape[-1]
    v_pad, dout_pad = (F.pad(t, (0, d - dv)) for t in (v, dout))
    grad = d <= 128  # past 128 no Hopper backward: the forward alone (a call that needs grad is refused)
    narrow = peers.Jagflash(peers.Inputs(*(t.clone().requires_grad_(grad) for t in (q, k, v)), dout, offsets,
                                         lengths, causal, 0))
    square_inputs = peers.Inputs(*(t.clone().requires_grad_(grad) for t in (q, k, v_pad)), dout_pad, offsets,
                                 lengths, causal, 0)
    impls = {"narrow": narrow, "square": peers.Jagflash(square_inputs)}
    notes = {}
    try:
        impls["fa2"] = peers.make("FA2 varlen", square_inputs)
    except Exception as e:  # noqa: BLE001 - the peer missing must not stop the run
        notes["fa2"] = f"{type(e).__name__}: {e}"
    fwd = compare.measure_interleaved({n: i.forward for n, i in impls.items()}, device, args.warmup, args.iters,
                                      args.budget_s, args.fwd_calls)
    row = {"error_vs_fa2": None}
    live = {n: r for n, r in fwd.items() if not isinstance(r, Exception)}
    for n, r in fwd.items():
        if isinstance(r, Exception):
            notes[n] = f"{type(r).__name__}: {r}"
    if "narrow" in live and "fa2" in live:
        ours, theirs = live["narrow"][1].detach().float(), live["fa2"][1].detach().float()[..., :dv]
        row["error_vs_fa2"] = ((ours - theirs).abs().max() / theirs.abs().max().clamp_min(1e-30)).item()
    bwd = compare.measure_interleaved({n: functools.partial(impls[n].backward, live[n][1]) for n in live}, device,
                                      args.warmup, args.iters, args.budget_s, args.bwd_calls)
    for n in ("narrow", "square", "fa2"):
        row[f"{n}_fwd_ms"] = live[n][0] if n in live else None
        b = bwd.get(n)
        row[f"{n}_bwd_ms"] = None if b is None or isinstance(b, Exception) else b[0]
        if isinstance(b, Exception):
            notes[n + "_bwd"] = f"{type(b).__name__}: {b}"
    wrong = row["error_vs_fa2"] is not None and row["error_vs_fa2"] > WRONG
    for part in ("fwd", "bwd"):
        row[f"{part}_vs_square"] = ratio(row[f"square_{part}_ms"], row[f"narrow_{part}_ms"])
        row[f"{part}_vs_fa2"] = None if wrong else ratio(row[f"fa2_{part}_ms"], row[f"narrow_{part}_ms"])
    row["notes"] = notes
    return row


def table(rows):
    lines = ["| dist | D / Dv | mask | fwd ms (D,Dv) / (D,D) / FA2 | bwd ms (D,Dv) / (D,D) / FA2 | fwd vs (D,D) | "
             "bwd vs (D,D) | fwd vs FA2 | bwd vs FA2 | err vs FA2 |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['dist']} | {r['head_dim']} / {r['v_head_dim']} | {r['mask']} | "
            f"{fmt(r['narrow_fwd_ms'], '{:.3f}')} / {fmt(r['square_fwd_ms'], '{:.3f}')} / "
            f"{fmt(r['fa2_fwd_ms'], '{:.3f}')} | {fmt(r['narrow_bwd_ms'], '{:.3f}')} / "
            f"{fmt(r['square_bwd_ms'], '{:.3f}')} / {fmt(r['fa2_bwd_ms'], '{:.3f}')} | "
            f"{fmt(r['fwd_vs_square'])} | {fmt(r['bwd_vs_square'])} | {fmt(r['fwd_vs_fa2'])} | "
            f"{fmt(r['bwd_vs_fa2'])} | {fmt(r['error_vs_fa2'], '{:.1e}')} |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    device = torch.device("cuda")
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator(device=device).manual_seed(jagflash.DEFAULT_SEED)
    rows = []
    for dist in args.dists:
        lengths = jagflash.generate_lengths(dist, jagflash.DEFAULT_SEED)
        offsets = peers.offsets_of(lengths, device)
        for pair in args.pairs:
            d, dv = (int(x) for x in pair.split(":"))

            def draw(width):
                return torch.randn((sum(lengths), args.heads, width), generator=generator,
                                   device=device).to(torch.bfloat16)

            q, k, v, dout = draw(d), draw(d), draw(dv), draw(dv)
            for mask in args.masks:
                row = {"dist": dist, "head_dim": d, "v_head_dim": dv, "mask": mask,
                       **run_case(q, k, v, dout, offsets, lengths, mask == "causal", args, device)}
                rows.append(row)
                (out_dir / "v_head_dim.json").write_text(json.dumps(rows, indent=1))
                print(f"{dist:>9} {d}/{dv} {mask:>6}: vs (D,D) fwd {fmt(row['fwd_vs_square'])} bwd "
                      f"{fmt(row['bwd_vs_square'])}; vs FA2 fwd {fmt(row['fwd_vs_fa2'])} bwd {fmt(row['bwd_vs_fa2'])}; "
                      f"err {fmt(row['error_vs_fa2'], '{:.1e}')} {row['notes'] or ''}", flush=True)
            del q, k, v, dout
            torch.cuda.empty_cache()
    print("\nv head dim of its own (bf16, H = %d; ratios > 1: jagflash at (D, Dv) faster)" % args.heads)
    print(table(rows))


if __name__ == "__main__":
    main()
