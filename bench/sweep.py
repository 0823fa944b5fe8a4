#!/usr/bin/env python3
"""The backward's steady state: uniform batches at a fixed token count (B x L = --tokens) for
L = 512 ... 16384, D = 128 and 64, no mask and causal, forward and backward, jagflash beside
FlashAttention-3 varlen and FA2 varlen in one process, the runs taken in turns (compare.py's
measure_interleaved). Then two batches of our own that nothing is tuned for (--own): document
packing (log-normal lengths around 900, clipped to [64, 8192]) and bimodal (32- and 4096-token
sequences), at the same token count.

The first thing to run after each kernel change (issue 24):

    python bench/sweep.py                                  # on the GPU machine: the 24 points + own batches
    python bench/sweep.py --head-dims 128 --masks none --lengths 2048 16384
    python bench/sweep.py --variant plain:JAGFLASH_BWD_L2_GROUP_MB=0,JAGFLASH_BWD_ROTATE=0
    python bench/sweep.py --from DIR --update-results      # here: append DIR's section to log/RESULTS-history.md
    python bench/sweep.py --device cpu --tokens 512 --lengths 64 128 --head-dims 64 --impls jagflash
    python bench/sweep.py --parts fwd --own --impls jagflash FA3_varlen cuDNN_ragged   # forward vs cuDNN

cuDNN ragged (only when named in --impls) is a forward peer timed by its GPU kernels in
torch.profiler, checked against jagflash's output first, skipped with a note where it cannot run
or is wrong (compare.check_then_profile).

A --variant NAME:VAR=VALUE,... adds "jagflash NAME", jagflash with those environment variables set
around each of its calls (the backward's tile-order knobs are read at every launch), timed in the
same turns as the others: an A/B inside one process.

Writes sweep.json (every number), sweep.md (a section for the dated log, bench/log/RESULTS-history.md) and a chart (TFLOP/s
against L, one line per implementation, a panel per head dim and mask) into --out (default
$OUT, else bench/out), and prints the backward's table and the issue's bars last.
"""
import argparse
import contextlib
import datetime
import functools
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "python"))
sys.path.insert(0, str(HERE))

import jagflash  # noqa: E402
import compare  # noqa: E402
import peers  # noqa: E402
import report  # noqa: E402

DEFAULT_IMPLS = ("jagflash", "FA3 varlen", "FA2 varlen")
BWD_FLOPS = compare.BWD_FLOPS
OWN_BATCHES = ("docpack", "bimodal")
OWN_SEED = 20261202


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", str(HERE / "out")))
    p.add_argument("--tokens", type=int, default=131072, help="B x L of every uniform batch")
    p.add_argument("--lengths", nargs="+", type=int, default=[512, 1024, 2048, 4096, 8192, 16384])
    p.add_argument("--head-dims", nargs="+", type=int, default=[128, 64])
    p.add_argument("--masks", nargs="+", default=["none", "causal"], choices=["none", "causal"])
    p.add_argument("--own", nargs="*", default=list(OWN_BATCHES), choices=OWN_BATCHES,
                   help="our own batches after the sweep (none: --own with no name)")
    p.add_argument("--impls", nargs="+", default=list(DEFAULT_IMPLS), choices=peers.IMPLEMENTATIONS,
                   type=peers.impl_name, help="names with _ for spaces also: FA3_varlen, cuDNN_ragged")
    p.add_argument("--variant", action="append", default=[],
                   help="NAME:VAR=VALUE[,VAR=VALUE...]: jagflash again with these environment variables")
    p.add_argument("--parts", nargs="+", default=["fwd", "bwd"], choices=["fwd", "bwd"])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=jagflash.DEFAULT_SEED)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--fwd-calls", type=int, default=2)
    p.add_argument("--bwd-calls", type=int, default=2)
    p.add_argument("--budget-s", type=float, default=1.0)
    p.add_argument("--commit", default=None)
    p.add_argument("--from", dest="from_dir", default=None, help="re-render DIR/sweep.json; run nothing")
    p.add_argument("--update-results", action="store_true", help="append the section to bench/log/RESULTS-history.md and put the chart in bench/")
    args = p.parse_args(argv)
    # What compare.environment() and compare.measure_all() read.
    args.order, args.dtype, args.scale, args.max_batch, args.dists = "interleaved", "bf16", 1, 0, []
    args.variants = [parse_variant(v) for v in args.variant]
    return args


def parse_variant(text):
    """'NAME:VAR=VALUE,VAR=VALUE' -> (NAME, {VAR: VALUE})."""
    name, sep, assignments = text.partition(":")
    env = {}
    for item in filter(None, assignments.split(",")):
        var, eq, value = item.partition("=")
        if not eq or not var:
            raise SystemExit(f"sweep.py: --variant {text!r}: expected NAME:VAR=VALUE[,VAR=VALUE...]")
        env[var] = value
    if not sep or not name or not env:
        raise SystemExit(f"sweep.py: --variant {text!r}: expected NAME:VAR=VALUE[,VAR=VALUE...]")
    return name, env


@contextlib.contextmanager
def environment_set(env):
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class JagflashVariant(peers.Jagflash):
    """jagflash with environment knobs set around each call (read by the library at launch)."""

    def __init__(self, x, env):
        super().__init__(x)
        self.env = env

    def forward(self):
        with environment_set(self.env):
            return super().forward()

    def backward(self, out, retain_graph=True):
        with environment_set(self.env):
            return super().backward(out, retain_graph)


def own_lengths(name, tokens, seed=OWN_SEED):
    """Our own batches at about `tokens` tokens (the last sequence trimmed to hit it exactly)."""
    rng = random.Random(f"{name}-{seed}")
    lengths = []
    while sum(lengths) < tokens:
        if name == "docpack":
            n = int(min(8192, max(64, math.exp(rng.gauss(math.log(900), 0.9)))))
        else:  # bimodal: many short, a few long (a quarter of the tokens' sequences long)
            n = 4096 if rng.random() < 0.03 else 32
        lengths.append(n)
    lengths[-1] -= sum(lengths) - tokens
    return [n for n in lengths if n > 0]


def cases(args):
    """(name, lengths) of every batch of the run: the uniform sweep, then our own."""
    out = []
    for length in args.lengths:
        batch = max(1, args.tokens // length)
        out.append((f"uniform{length}", [length] * batch))
    for name in args.own:
        out.append((name, own_lengths(name, args.tokens)))
    return out


def implementations(args, inputs):
    impls, failed = {}, {}
    for name in args.impls:
        try:
            impls[name] = peers.make(name, inputs)
        except Exception as e:  # noqa: BLE001 - one peer that cannot run must not stop the others
            failed[name] = e
    for vname, env in args.variants:
        impls[f"jagflash {vname}"] = JagflashVariant(inputs, env)
    return impls, failed


def time_case(args, inputs, device):
    """{impl: {fwd_ms, bwd_ms, out, grads} or exception (peers.Skip: a note)}. A profiler-timed
    implementation (cuDNN ragged) is checked against jagflash's forward, then timed, after the
    others' forwards (compare.check_then_profile)."""
    impls, results = implementations(args, inputs)
    profiled = {n: i for n, i in impls.items() if getattr(i, "timer", None) == "profiler"}
    impls = {n: i for n, i in impls.items() if n not in profiled}
    if "fwd" in args.parts:
        forwards = compare.measure_all({n: i.forward for n, i in impls.items()}, device, args, args.fwd_calls)
    else:
        forwards = {}
        for n, i in impls.items():
            try:
                forwards[n] = (None, i.forward())
            except Exception as e:  # noqa: BLE001
                forwards[n] = e
    live = {}
    for n, r in forwards.items():
        if isinstance(r, Exception):
            results[n] = r
        else:
            live[n] = {"impl": impls[n], "fwd_ms": r[0], "out": r[1], "bwd_ms": None, "grads": ()}
    reference = compare.reference_output(list(impls), live) if profiled else None
    for n, impl in profiled.items():
        results[n] = compare.check_then_profile(impl, reference, device, args)
    del reference
    if "bwd" in args.parts:
        fns = {n: functools.partial(impls[n].backward, t["out"]) for n, t in live.items()}
        for n, r in compare.measure_all(fns, device, args, args.bwd_calls).items():
            if isinstance(r, Exception):
                results[n] = r
                del live[n]
            else:
                live[n]["bwd_ms"], live[n]["grads"] = r
    results.update(live)
    return results


def run(args):
    device = torch.device(args.device)
    meta = compare.environment(args, device)
    meta.update(command="python bench/sweep.py " + " ".join(sys.argv[1:]), tokens=args.tokens,
                variants={n: e for n, e in args.variants}, impls=list(args.impls) +
                [f"jagflash {n}" for n, _ in args.variants], dists=[c for c, _ in cases(args)])
    compare.skip_unavailable(args, meta)
    meta["impls"] = list(args.impls) + [f"jagflash {n}" for n, _ in args.variants]
    generator = torch.Generator(device=device).manual_seed(args.seed)
    rows = []
    out_dir = Path(args.out)
    for case, lengths in cases(args):
        total = sum(lengths)
        offsets = peers.offsets_of(lengths, device)
        for head_dim in args.head_dims:
            def rnd():
                return torch.randn((total, args.heads, head_dim), generator=generator, device=device).to(torch.bfloat16)

            q, k, v, dout = rnd(), rnd(), rnd(), rnd()
            for mask in args.masks:
                causal = mask == "causal"
                inputs = peers.Inputs(*(t.clone().requires_grad_() for t in (q, k, v)), dout, offsets, lengths,
                                      causal, -(-total // 128) * 128)
                pairs = sum(jagflash.visible_pairs(n, n, causal=causal) for n in lengths)
                flops = 4.0 * args.heads * head_dim * pairs
                t0 = time.time()
                timed = time_case(args, inputs, device)
                reference = None
                for name in meta["impls"]:
                    row = {"case": case, "length": lengths[0] if case.startswith("uniform") else None,
                           "batch": len(lengths), "head_dim": head_dim, "mask": mask, "impl": name}
                    r = timed.get(name)
                    if isinstance(r, peers.Skip):
                        row["skipped"] = str(r)
                    elif r is None or isinstance(r, Exception):
                        row["error"] = compare._error_text(r) if r is not None else "not run"
                    else:
                        for part, factor in (("fwd", 1.0), ("bwd", BWD_FLOPS)):
                            if r[f"{part}_ms"] is not None:
                                row[f"{part}_ms"] = r[f"{part}_ms"]
                                row[f"{part}_tflops"] = factor * flops / r[f"{part}_ms"] / 1e9
                        row.update({key: r[key] for key in compare.PROFILED_FIELDS if key in r})
                        result = (r["out"].detach(), *r["grads"])
                        if reference is None and name == "jagflash":
                            reference = result
                        elif reference is not None:
                            pairs = list(zip(result, reference))
                            row["max_err"] = max(compare.normalised_error(a, b) for a, b in pairs)
                            row["max_abs_err"] = max(compare.max_abs_error(a, b) for a, b in pairs)
                            row["mismatch"] = row["max_err"] > compare.MISMATCH_TOL
                        elif "max_abs_err" in r:
                            row["max_abs_err"] = r["max_abs_err"]
                    rows.append(row)
                    print(progress(row), flush=True)
                print(f"  ({time.time() - t0:.0f} s)", flush=True)
                del timed, reference, inputs
                save(out_dir, meta, rows)
            del q, k, v, dout
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return meta, rows


def progress(row):
    what = f"{row['case']:>12} D{row['head_dim']:<3} {row['mask']:>6} {row['impl']:<18}"
    if row.get("error"):
        return f"{what} ERROR {row['error']}"
    if row.get("skipped"):
        return f"{what} SKIPPED {row['skipped']}"
    parts = [f"{p} {row[p + '_ms']:8.3f} ms {row[p + '_tflops']:6.1f} TFLOP/s" for p in ("fwd", "bwd")
             if row.get(p + "_ms") is not None]
    err = f"  err {row['max_err']:.2g}" if row.get("max_err") is not None else ""
    err += compare.progress_note(row)
    return f"{what} {'   '.join(parts)}{err}"


def save(out_dir, meta, rows):
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "sweep.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


def lookup(rows):
    return {(r["case"], r["head_dim"], r["mask"], r["impl"]): r for r in rows}


def _tf(r, part):
    return None if r is None or r.get("error") else r.get(f"{part}_tflops")


def table(meta, rows, part="bwd", peer="FA3 varlen"):
    """Markdown: one row per (D, mask), one column per case: 'jagflash / peer (ratio)'."""
    by = lookup(rows)
    case_names = list(dict.fromkeys(r["case"] for r in rows))
    combos = list(dict.fromkeys((r["head_dim"], r["mask"]) for r in rows))
    head = "| D | mask | " + " | ".join(c.replace("uniform", "L=") for c in case_names) + " |"
    lines = [head, "|---|---|" + "---|" * len(case_names)]
    for d, mask in combos:
        cells = []
        for c in case_names:
            peer_row = by.get((c, d, mask, peer))
            mine, theirs = _tf(by.get((c, d, mask, "jagflash")), part), _tf(peer_row, part)
            if mine is None:
                cells.append("-")
            elif peer_row is not None and peer_row.get("skipped"):
                cells.append(f"{mine:.0f} / skipped{report.SKIPPED_MARK}")
            elif theirs is None:
                cells.append(f"{mine:.0f}")
            else:
                cells.append(f"{mine:.0f} / {theirs:.0f} ({mine / theirs:.2f})")
        lines.append(f"| {d} | {mask} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def variants_table(meta, rows, part="bwd"):
    """Markdown: each jagflash variant's TFLOP/s over the default's, per point (the A/B)."""
    names = [n for n in meta["impls"] if n.startswith("jagflash ")]
    if not names or not any(r["impl"] == "jagflash" and _tf(r, part) is not None for r in rows):
        return ""  # no variant, or this part not measured (--parts)
    by = lookup(rows)
    lines = ["| case | D | mask | jagflash | " + " | ".join(names) + " |", "|---|---|---|---|" + "---|" * len(names)]
    for r in rows:
        if r["impl"] != "jagflash":
            continue
        base = _tf(r, part)
        cells = []
        for n in names:
            other = _tf(by.get((r["case"], r["head_dim"], r["mask"], n)), part)
            cells.append("-" if other is None or base is None else f"{other:.0f} ({other / base:.2f})")
        lines.append(f"| {r['case']} | {r['head_dim']} | {r['mask']} | "
                     f"{'-' if base is None else f'{base:.0f}'} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def bars(rows):
    """Issue 24's sweep bars, as lines: >= 1.0x FA3 on every uniform point; >= 550 TFLOP/s at
    D = 128, no mask, L >= 4096; TFLOP/s not falling as L grows."""
    by = lookup(rows)
    out = []
    uniform = [r for r in rows if r["impl"] == "jagflash" and r.get("length")]
    below = []
    for r in uniform:
        mine, fa3 = _tf(r, "bwd"), _tf(by.get((r["case"], r["head_dim"], r["mask"], "FA3 varlen")), "bwd")
        if mine is not None and fa3 is not None and mine < fa3:
            below.append(f"{r['case']} D{r['head_dim']} {r['mask']} {mine / fa3:.2f}")
    have_fa3 = any(r["impl"] == "FA3 varlen" and not r.get("error") for r in rows)
    measured = any(_tf(r, "bwd") is not None for r in uniform)
    verdict = 'MET' if not below else 'NOT MET (' + ', '.join(below) + ')'
    out.append(f"bar >= 1.0x FA3 on every uniform point: "
               f"{'no FA3 in this run' if not have_fa3 else verdict if measured else 'not measured'}")
    long = [r for r in uniform if r["head_dim"] == 128 and r["mask"] == "none" and r["length"] >= 4096
            and _tf(r, "bwd") is not None]  # a --parts fwd run measures no backward
    low = [f"L={r['length']} {_tf(r, 'bwd'):.0f}" for r in long if (_tf(r, "bwd") or 0) < 550]
    out.append(f"bar >= 550 TFLOP/s at D=128 none L>=4096: {'not measured' if not long else ('MET' if not low else 'NOT MET (' + ', '.join(low) + ')')}")
    falls = []
    for d in sorted({r["head_dim"] for r in uniform}):
        for mask in ("none", "causal"):
            line = sorted((r["length"], _tf(r, "bwd")) for r in uniform if r["head_dim"] == d and r["mask"] == mask
                          and _tf(r, "bwd") is not None)
            for (l0, t0), (l1, t1) in zip(line, line[1:]):
                if t1 < t0 * 0.98:  # within 2%: the run-to-run noise of one point
                    falls.append(f"D{d} {mask} {l0}->{l1}: {t0:.0f}->{t1:.0f}")
    out.append(f"bar backward TFLOP/s does not fall as L grows: "
               f"{('MET' if not falls else 'NOT MET (' + ', '.join(falls) + ')') if measured else 'not measured'}")
    return out


def markdown(meta, rows, png_name):
    lines = [f"## bench/sweep.py, {meta['date']}, {meta['commit']}", "",
             f"`{meta['command']}` on {meta['gpu']} (torch {meta['torch']}, CUDA {meta['cuda']}); bf16, "
             f"H = {meta['heads']}, {meta['tokens']} tokens a batch (uniform: B x L), TFLOP/s of useful work "
             f"(backward {BWD_FLOPS}x the forward's FLOPs), medians of samples taken in turns "
             f"({meta['bwd_calls']} calls a sample); implementations: {', '.join(meta['impls'])}.", ""]
    if meta.get("skipped"):
        lines += [f"Skipped: {', '.join(f'{k} ({v})' for k, v in meta['skipped'].items())}", ""]
    if meta.get("variants"):
        lines += ["Variants: " + "; ".join(f"`jagflash {n}` = " + " ".join(f"{k}={v}" for k, v in e.items())
                                          for n, e in meta["variants"].items()), ""]
    lines += ["Backward, jagflash / FA3 varlen (ratio):", "", table(meta, rows, "bwd"), "",
              "Backward, jagflash / FA2 varlen (ratio):", "", table(meta, rows, "bwd", "FA2 varlen"), "",
              "Forward, jagflash / FA3 varlen (ratio):", "", table(meta, rows, "fwd"), ""]
    if peers.FA4 in meta["impls"]:
        lines += [f"Backward, jagflash / {peers.FA4} (ratio):", "", table(meta, rows, "bwd", peers.FA4), "",
                  f"Forward, jagflash / {peers.FA4} (ratio):", "", table(meta, rows, "fwd", peers.FA4), ""]
    if peers.CUDNN in meta["impls"]:
        lines += [f"Forward, jagflash / {peers.CUDNN}{report.KERNEL_TIME_MARK} (ratio):", "",
                  table(meta, rows, "fwd", peers.CUDNN), ""]
        lines += [f"- {n}" for n in filter(None, [report.kernel_timed_note(meta, rows)])]
        lines += [f"- {n}" for n in report.skipped_notes(rows)] + [""]
    for part, what in (("fwd", "Forward"), ("bwd", "Backward")):
        vt = variants_table(meta, rows, part)
        if vt:
            lines += [f"{what} of each variant (ratio to jagflash's default):", "", vt, ""]
    lines += [f"- {b}" for b in bars(rows)]
    errs = [r for r in rows if r.get("mismatch")]
    if errs:
        lines += [f"- MISMATCH: {r['impl']} {r['case']} D{r['head_dim']} {r['mask']} err {r['max_err']:.3g}" for r in errs]
    if png_name:
        lines += ["", f"![sweep]({png_name})"]
    return "\n".join(lines) + "\n"


def chart(meta, rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    combos = list(dict.fromkeys((r["head_dim"], r["mask"]) for r in rows if r.get("length")))
    fig, axes = plt.subplots(2, len(combos), figsize=(4.2 * len(combos), 7), squeeze=False)
    for col, (d, mask) in enumerate(combos):
        for row_i, part in enumerate(("bwd", "fwd")):
            ax = axes[row_i][col]
            for impl in meta["impls"]:
                pts = sorted((r["length"], _tf(r, part)) for r in rows if r.get("length") and r["impl"] == impl
                             and r["head_dim"] == d and r["mask"] == mask and _tf(r, part) is not None)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{'backward' if part == 'bwd' else 'forward'}, D={d}, {mask}")
            ax.set_xlabel("L (uniform, B x L fixed)")
            ax.set_ylabel("TFLOP/s")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(f"bench/sweep.py {meta['date']} {meta['commit']} ({meta['gpu']})")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main():
    args = parse_args()
    out_dir = Path(args.out)
    if args.from_dir:
        saved = json.loads((Path(args.from_dir) / "sweep.json").read_text())
        meta, rows = saved["meta"], saved["rows"]
        if args.commit:
            meta["commit"] = args.commit
    else:
        t0 = time.time()
        meta, rows = run(args)
        meta["seconds"] = round(time.time() - t0, 1)
        save(out_dir, meta, rows)
    out_dir.mkdir(parents=True, exist_ok=True)
    png_name = f"sweep-{meta['date']}-{meta['commit'].replace('+', '-')}.png"
    try:
        chart(meta, rows, out_dir / png_name)
    except ImportError as e:
        print(f"sweep.py: no chart ({e}); render it later with --from {out_dir}")
        png_name = None
    section = markdown(meta, rows, png_name)
    (out_dir / "sweep.md").write_text(section)
    if args.update_results:
        history, png = report.append_results(section, out_dir / png_name if png_name else None, HERE)
        print(f"appended to {history}; chart {png}; bring bench/RESULTS.md's section up to date by hand")
    print("sweep.py: backward TFLOP/s, jagflash / FA3 varlen (ratio)")
    print(table(meta, rows, "bwd"))
    # After the backward's table, so that scripts/gpu-sweep.sh's summary (from that line on) has them.
    print("sweep.py: forward TFLOP/s, jagflash / FA3 varlen (ratio)")
    print(table(meta, rows, "fwd"))
    if peers.FA4 in meta["impls"]:
        print(f"sweep.py: backward TFLOP/s, jagflash / {peers.FA4} (ratio)")
        print(table(meta, rows, "bwd", peers.FA4))
        print(f"sweep.py: forward TFLOP/s, jagflash / {peers.FA4} (ratio)")
        print(table(meta, rows, "fwd", peers.FA4))
    if peers.CUDNN in meta["impls"]:
        print(f"sweep.py: forward TFLOP/s, jagflash / {peers.CUDNN} (ratio; its GPU kernels' time from torch.profiler)")
        print(table(meta, rows, "fwd", peers.CUDNN))
    for part, what in (("fwd", "forward"), ("bwd", "backward")):
        vt = variants_table(meta, rows, part)
        if vt:
            print(f"sweep.py: variants, {what} TFLOP/s (ratio to jagflash)")
            print(vt)
    for b in bars(rows):
        print(b)
    failed = [r for r in rows if (r["impl"].startswith("jagflash") and r.get("error")) or r.get("mismatch")]
    for r in failed:
        print(f"FAILED: {r['impl']} {r['case']} D{r['head_dim']} {r['mask']}: {r.get('error') or r.get('max_err')}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
