"""Score modifiers on the GPU: jagflash with a tanh softcap or ALiBi against jagflash without one
(issue 26's bar: >= 0.9x) and against FlexAttention running the same score_mod on the same
batches (>= 2x), forward and backward, on the five distributions (and the sweep's two batches of
our own, not tuned for: --dists).

    python bench/score_mod.py [--dists ...] [--head-dims 128 64] [--masks none causal]
                              [--mods softcap alibi relative_bias] [--softcap 30] [--out DIR]

Each case draws q, k, v, dout from N(0, 1) in bf16 (compare.py's draw) and times, in turns
(compare.measure_interleaved: medians of CUDA-event samples, the three interleaved), jagflash
without a modifier, jagflash with it, and FlexAttention (compiled, on the batch padded to one length
with a document block mask, peers.FlexAttention) with the modifier as its score_mod: softcap
`cap * tanh(score / cap)`, ALiBi `score - slope[h] * |q_idx - kv_idx|`, the relative bias
`score + table[h, clip(kv_idx - q_idx, -128, 128) + 128]` (self-attention inside a document: the
packed indices differ by i - j). Before timing, jagflash's output with the modifier is
checked against FlexAttention's (max |difference| / max |FlexAttention's|, printed); a case over
5e-2 is reported as wrong and its ratios are left out. Writes score_mod.json and prints a table
last.
"""
import argparse
import json
import os
import pathlib
import sys
import time

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import compare  # noqa: E402
import peers  # noqa: E402
from compare import fmt  # noqa: E402

import jagflash  # noqa: E402

MODS = ("softcap", "alibi", "relative_bias")
REACH = 128  # relative_bias: distances -128..128 (a [H, 257] table)
WRONG = 5e-2


def alibi_slopes(heads, device):
    """BLOOM's slopes 2^(-8 (h + 1) / H)."""
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)], dtype=torch.float32,
                        device=device)


def modifier(mod, cap, heads, device):
    """(jagged_attention's keyword arguments, FlexAttention's score_mod) of one modifier."""
    if mod == "softcap":
        def softcap(score, b, h, q_idx, kv_idx):
            return cap * torch.tanh(score / cap)
        return {"softcap": cap}, softcap
    if mod == "relative_bias":
        table = torch.randn(heads, 2 * REACH + 1, generator=torch.Generator().manual_seed(7)).to(device)

        def relative_bias(score, b, h, q_idx, kv_idx):
            return score + table[h, (kv_idx - q_idx).clamp(-REACH, REACH) + REACH]
        return {"score_mod": "relative_bias", "score_mod_table": table}, relative_bias
    slopes = alibi_slopes(heads, device)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()
    return {"alibi_slopes": slopes}, alibi


class JagflashModified(peers.Jagflash):
    def __init__(self, x, kwargs):
        super().__init__(x)
        self.kwargs = kwargs

    def forward(self):
        return jagflash.jagged_attention(self.x.q, self.x.k, self.x.v, self.x.offsets, causal=self.x.causal,
                                         check_offsets="device", max_seqlen_q=self.x.max_len, **self.kwargs)


class FlexModified(peers.FlexAttention):
    def __init__(self, x, score_mod):
        super().__init__(x, compile_flex=True)
        self.score_mod = score_mod

    def forward(self):
        q, k, v = (t.unsqueeze(0).transpose(1, 2) for t in self.leaves)
        return self.fn(q, k, v, score_mod=self.score_mod, block_mask=self.block_mask)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", str(HERE / "out")))
    p.add_argument("--dists", nargs="+", default=list(jagflash.DISTRIBUTIONS))
    p.add_argument("--head-dims", nargs="+", type=int, default=[128])
    p.add_argument("--masks", nargs="+", default=["none", "causal"], choices=["none", "causal"])
    p.add_argument("--mods", nargs="+", default=list(MODS), choices=MODS)
    p.add_argument("--softcap", type=float, default=30.0)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--fwd-calls", type=int, default=4)
    p.add_argument("--bwd-calls", type=int, default=2)
    p.add_argument("--budget-s", type=float, default=1.0)
    p.add_argument("--no-flex", action="store_true", help="leave FlexAttention out (quick runs)")
    return p.parse_args(argv)


def ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def run_case(x, mod, args, device):
    kwargs, score_mod = modifier(mod, args.softcap, args.heads, device)
    impls = {"plain": peers.Jagflash(x), "modified": JagflashModified(x, kwargs)}
    notes = {}
    if not args.no_flex:
        try:
            impls["flex"] = FlexModified(x, score_mod)
        except Exception as e:  # noqa: BLE001 - the peer missing must not stop the run
            notes["flex"] = f"{type(e).__name__}: {e}"
    row = {"mod": mod}
    row.update(compare.time_beside_reference(impls, ("plain", "modified", "flex"), "modified", args, device, notes))
    error = row["error_vs_flex"]
    wrong = error is not None and error > WRONG
    for d in ("fwd", "bwd"):
        # Speed ratios: > 1 is faster. vs plain = plain time / modified time (bar >= 0.9).
        row[f"{d}_vs_plain"] = ratio(row[f"plain_{d}_ms"], row[f"modified_{d}_ms"])
        row[f"{d}_vs_flex"] = None if wrong else ratio(row[f"flex_{d}_ms"], row[f"modified_{d}_ms"])
    row["notes"] = notes
    return row


def table(rows):
    return compare.beside_table(
        rows, [("dist", "dist"), ("D", "head_dim"), ("mask", "mask"), ("mod", "mod")],
        ("plain", "modified", "flex"), "plain / mod / flex",
        [("fwd vs plain", "fwd_vs_plain"), ("bwd vs plain", "bwd_vs_plain"), ("fwd vs flex", "fwd_vs_flex"),
         ("bwd vs flex", "bwd_vs_flex")], "flex", "flex")


def main(argv=None):
    args = parse_args(argv)
    device = torch.device("cuda")
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    lengths_of = {d: jagflash.generate_lengths(d, jagflash.DEFAULT_SEED) for d in args.dists}
    flex_length = -(-max(sum(v) for v in lengths_of.values()) // 128) * 128
    generator = torch.Generator(device=device).manual_seed(jagflash.DEFAULT_SEED)
    rows = []
    for dist, lengths in lengths_of.items():
        offsets = peers.offsets_of(lengths, device)
        for head_dim in args.head_dims:
            shape = (sum(lengths), args.heads, head_dim)
            q, k, v, dout = (torch.randn(shape, generator=generator, device=device).to(torch.bfloat16)
                             for _ in range(4))
            for mask in args.masks:
                for mod in args.mods:
                    t0 = time.time()
                    x = peers.Inputs(*(t.clone().requires_grad_() for t in (q, k, v)), dout, offsets, lengths,
                                     mask == "causal", flex_length)
                    row = {"dist": dist, "head_dim": head_dim, "mask": mask, **run_case(x, mod, args, device)}
                    rows.append(row)
                    (out_dir / "score_mod.json").write_text(json.dumps(rows, indent=1))
                    print(f"{dist:>9} D{head_dim} {mask:>6} {mod:>7}: fwd x{fmt(row['fwd_vs_plain'])} "
                          f"bwd x{fmt(row['bwd_vs_plain'])} of plain; vs flex fwd {fmt(row['fwd_vs_flex'])} "
                          f"bwd {fmt(row['bwd_vs_flex'])}; err {fmt(row['error_vs_flex'], '{:.1e}')} "
                          f"{row['notes'] or ''} ({time.time() - t0:.0f} s)", flush=True)
                    del x
            del q, k, v, dout
            torch.cuda.empty_cache()
    print("\nscore modifiers (H200, bf16, H = %d, softcap %g; ratios > 1: jagflash with the modifier faster)"
          % (args.heads, args.softcap))
    print(table(rows))


if __name__ == "__main__":
    main()
