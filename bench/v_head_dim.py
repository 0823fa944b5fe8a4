"""A v head dim of its own (Dv < D) on the GPU: jagflash at (D, Dv) against jagflash at (D, D) and
FA2 varlen at (D, D) (PyTorch's _flash_attention_forward / _backward take one head dim for q, k
and v, so a caller with a narrower v pads it to D: the peer's cost for the same call), forward and
backward, on the five distributions.

    python bench/v_head_dim.py [--dists ...] [--pairs 128:64 64:32 192:128] [--masks none causal] [--out DIR]

Each case draws q, k from N(0, 1) [T, H, D] and v, dout [T, H, Dv] in bf16 (the (D, D) calls take v
and dout zero-padded to D, so all three compute the same attention) and times the three in turns
(compare.time_beside_reference: medians of CUDA-event samples). Before timing, jagflash's (D, Dv)
output is checked against FA2's first Dv columns (max |difference| / max |FA2's|; over 5e-2 the
case is reported wrong and its ratios left out). Writes v_head_dim.json and prints a table last.
"""
import argparse
import gc
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
from compare import fmt  # noqa: E402

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


def run_case(q, k, v, dout, offsets, lengths, causal, args, device):
    d, dv = q.shape[-1], v.shape[-1]
    v_pad, dout_pad = (F.pad(t, (0, d - dv)) for t in (v, dout))
    grad = True  # the Hopper backward serves every (D, Dv <= D) pair
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
    # FA2's output is [T, H, D] (v padded): the helper compares its first Dv columns with narrow's.
    # A refused backward (192:128) is noted as "<name>_bwd", the forward having run.
    row = compare.time_beside_reference(impls, ("narrow", "square", "fa2"), "narrow", args, device, notes,
                                        reference="fa2", bwd_note_suffix="_bwd")
    wrong = row["error_vs_fa2"] is not None and row["error_vs_fa2"] > WRONG
    for part in ("fwd", "bwd"):
        row[f"{part}_vs_square"] = ratio(row[f"square_{part}_ms"], row[f"narrow_{part}_ms"])
        row[f"{part}_vs_fa2"] = None if wrong else ratio(row[f"fa2_{part}_ms"], row[f"narrow_{part}_ms"])
    row["notes"] = notes
    return row


def table(rows):
    return compare.beside_table(
        rows, [("dist", "dist"), ("D / Dv", lambda r: f"{r['head_dim']} / {r['v_head_dim']}"), ("mask", "mask")],
        ("narrow", "square", "fa2"), "(D,Dv) / (D,D) / FA2",
        [("fwd vs (D,D)", "fwd_vs_square"), ("bwd vs (D,D)", "bwd_vs_square"), ("fwd vs FA2", "fwd_vs_fa2"),
         ("bwd vs FA2", "bwd_vs_fa2")], "fa2", "FA2")


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
                gc.collect()  # the case's implementations and their graphs, before the next allocates
                torch.cuda.empty_cache()
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
