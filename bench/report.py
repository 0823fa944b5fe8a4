"""compare.py's outputs: the markdown section (for bench/RESULTS.md) and the PNG chart."""
from collections import defaultdict
from pathlib import Path

from peers import IMPLEMENTATIONS, PEERS

COLOURS = {"jagflash": "#d62728", "FA2 varlen": "#1f77b4", "varlen_attn": "#9ecae1", "FlexAttention": "#2ca02c"}


# Issue 4's forward bar, jagflash / FA2 varlen in the same run: FA3's ratio over FA2 from
# shared/bench/distributions.md (bf16, H = 16, D = 128), 1.5 x that on `short`, and 1.6 on
# gemskew at D = 64. Keys: (dist, mask, head dim).
FORWARD_BARS = {
    ("uniform1k", "none", 128): 1.64, ("gemskew", "none", 128): 1.81, ("pareto", "none", 128): 1.85,
    ("onegiant", "none", 128): 2.06, ("short", "none", 128): 1.5 * 1.05,
    ("uniform1k", "causal", 128): 1.90, ("gemskew", "causal", 128): 1.83, ("pareto", "causal", 128): 1.85,
    ("onegiant", "causal", 128): 2.25, ("short", "causal", 128): 1.5 * 1.92,
    ("gemskew", "none", 64): 1.6,
}


def bar_table(rows):
    """The forward bar against this run: per barred case, jagflash's and FA2's forward TFLOP/s,
    their ratio, the bar and whether it is met (None when the run has no barred case)."""
    cases = _by_case(rows)
    lines = ["| case | jagflash / FA2 | bar | met? |", "|---|---|---|---|"]
    met = total = 0
    for key, bar in FORWARD_BARS.items():
        impls = cases.get(key, {})
        mine, fa2 = _tflops(impls.get("jagflash"), "fwd"), _tflops(impls.get("FA2 varlen"), "fwd")
        if not mine or not fa2:
            continue
        ratio = mine / fa2
        total += 1
        met += ratio >= bar
        verdict = "**yes**" if ratio >= bar else f"no ({(ratio / bar - 1) * 100:+.0f}%)"
        dist, mask, head_dim = key
        lines.append(f"| {dist} {mask}, D = {head_dim} | {mine:.1f} / {fa2:.1f} = {ratio:.2f} | {bar:.2f} | {verdict} |")
    if total == 0:
        return None
    return "\n".join(lines) + f"\n\nBar met on {met} of {total} cases in this run.\n"


def _by_case(rows):
    """{(dist, mask, head_dim): {impl: row}}, ordered like distributions.md's tables: by head dim
    (largest first), mask (none first), then distribution in the order measured."""
    cases = defaultdict(dict)
    for row in rows:
        cases[(row["dist"], row["mask"], row["head_dim"])][row["impl"]] = row
    dist_order = {d: i for i, d in enumerate(dict.fromkeys(r["dist"] for r in rows))}
    mask_order = {"none": 0, "causal": 1}
    keys = sorted(cases, key=lambda k: (-k[2], mask_order.get(k[1], 2), dist_order[k[0]]))
    return {k: cases[k] for k in keys}


def _tflops(row, direction):
    if row is None or row.get("error") or row.get(f"{direction}_tflops") is None:
        return None
    return row[f"{direction}_tflops"]


def _cell(row):
    if row is None:
        return "—"
    if row.get("error"):
        return "error¹"
    fwd, bwd = _tflops(row, "fwd"), _tflops(row, "bwd")
    mark = "²" if row.get("mismatch") else ""
    return f"{fwd:.1f} / {bwd:.1f}{mark}"


def ratio_to_best_peer(impls, direction):
    """jagflash's TFLOP/s over the best peer's in this case (None when either is missing)."""
    mine = _tflops(impls.get("jagflash"), direction)
    peers = [t for t in (_tflops(impls.get(p), direction) for p in PEERS) if t]
    return mine / max(peers) if mine and peers else None


def _ratio_cell(impls):
    parts = [ratio_to_best_peer(impls, d) for d in ("fwd", "bwd")]
    return " / ".join("—" if r is None else f"{r:.3f}" for r in parts)


def table(rows):
    head = "| dist | mask | D | " + " | ".join(IMPLEMENTATIONS) + " | jagflash / best peer |"
    lines = [head, "|" + "---|" * (len(IMPLEMENTATIONS) + 4)]
    for (dist, mask, head_dim), impls in _by_case(rows).items():
        cells = " | ".join(_cell(impls.get(name)) for name in IMPLEMENTATIONS)
        lines.append(f"| {dist} | {mask} | {head_dim} | {cells} | {_ratio_cell(impls)} |")
    return "\n".join(lines)


def _order_note(meta):
    if meta.get("fwd_order") == "interleaved":
        return ("; the implementations' forward runs taken in turns (one run each per round, the order "
                "reversed every other round)")
    return "; each implementation's forward runs after the previous one's"


def markdown(meta, rows, png_name):
    errors = sorted({(r["impl"], r["error"]) for r in rows if r.get("error")})
    mismatches = [r for r in rows if r.get("mismatch")]
    lines = [
        f"## {meta['date']} — side by side with PyTorch's kernels (commit {meta['commit']})",
        "",
        f"Command: `{meta['command']}`. {meta['gpu']}; torch {meta['torch']} (CUDA {meta['cuda']}), "
        f"Triton {meta['triton']}, Python {meta['python']}, jagflash library {meta['jagflash']} "
        f"(default backend).",
        "",
        f"{meta['dtype']}, H = {meta['heads']}, self-attention on {', '.join(meta['dists'])} "
        f"(shared/bench/distributions.md, seed {meta['seed']}{meta['scale_note']}); TFLOP/s of useful work, forward / backward "
        f"(forward 4·H·D·visible pairs, backward 2.5×), median of up to {meta['iters']} timed runs "
        f"({meta['timer']}; a forward run is {meta.get('fwd_calls', 1)} call(s) queued back to back, "
        f"per call) after warm-up, capped at {meta['budget_s']} s per measurement"
        f"{_order_note(meta)}; all in one process on the same inputs. FlexAttention runs compiled, on copies padded to one common "
        "length (so it compiles once per head dim and mask) with a document block mask that lists "
        "no padding block. Backward: jagflash, varlen_attn and FlexAttention through autograd, FA2 "
        "through aten._flash_attention_backward.",
        "",
        table(rows),
        "",
        f"![jagflash and peers, TFLOP/s]({png_name})",
    ]
    bars = bar_table(rows)
    if bars:
        lines += ["", "Forward bar (issue 4: jagflash / FA2 against FA3 / FA2 of shared/bench/distributions.md; "
                  "1.5x that on short):", "", bars.rstrip("\n")]
    notes = []
    for impl, error in errors:
        notes.append(f"¹ {impl}: {error}")
    if mismatches:
        cases = ", ".join(f"{r['impl']} on {r['dist']}/{r['mask']}/D{r['head_dim']} ({r['max_err']:.2g})" for r in mismatches)
        notes.append(f"² output or gradients differ from jagflash's by more than {meta['mismatch_tol']} (normalised max error): {cases}")
    errs = [r["max_err"] for r in rows if r.get("max_err") is not None]
    if errs:
        notes.append(f"Largest normalised difference of any peer's out/dq/dk/dv from jagflash's: {max(errs):.2g}.")
    if notes:
        lines += [""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def chart(meta, rows, path):
    """Bars per distribution (and mask), one colour per implementation; forward and backward in
    rows, head dims in columns."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = _by_case(rows)
    head_dims = sorted({k[2] for k in cases}, reverse=True)
    fig, axes = plt.subplots(2, len(head_dims), figsize=(9 * len(head_dims), 9), squeeze=False)
    width = 0.8 / len(IMPLEMENTATIONS)
    for col, head_dim in enumerate(head_dims):
        keys = [k for k in cases if k[2] == head_dim]
        labels = [f"{dist}\n{mask}" for dist, mask, _ in keys]
        for row_index, direction in enumerate(("fwd", "bwd")):
            ax = axes[row_index][col]
            for i, impl in enumerate(IMPLEMENTATIONS):
                values = [_tflops(cases[k].get(impl), direction) or 0.0 for k in keys]
                positions = [x + (i - (len(IMPLEMENTATIONS) - 1) / 2) * width for x in range(len(keys))]
                ax.bar(positions, values, width, label=impl, color=COLOURS[impl])
                if impl == "jagflash":
                    # jagflash / best peer over each group: the number the issues' bars are about.
                    for x, key, value in zip(positions, keys, values):
                        ratio = ratio_to_best_peer(cases[key], direction)
                        if ratio is not None:
                            ax.annotate(f"×{ratio:.2f}", (x, value), xytext=(0, 2), textcoords="offset points",
                                        ha="center", va="bottom", fontsize=7, rotation=90)
            ax.set_xticks(range(len(keys)))
            ax.set_xticklabels(labels, fontsize=8)
            ax.set_ylabel("TFLOP/s (useful work)")
            ax.set_title(f"{'forward' if direction == 'fwd' else 'backward'}, D = {head_dim}")
            ax.grid(axis="y", alpha=0.3)
            ax.margins(y=0.15)  # room for the ratio labels
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(IMPLEMENTATIONS),
               title="× over a jagflash bar: jagflash / best peer", title_fontsize=8)
    fig.suptitle(f"jagflash vs PyTorch kernels — {meta['gpu']}, {meta['dtype']}, H = {meta['heads']}, "
                 f"{meta['date']}, commit {meta['commit']}")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def append_results(section, png_path, bench_dir):
    """Appends the section to bench/RESULTS.md and puts the chart next to it."""
    bench_dir = Path(bench_dir)
    target_png = bench_dir / Path(png_path).name
    if Path(png_path).resolve() != target_png.resolve():
        target_png.write_bytes(Path(png_path).read_bytes())
    with open(bench_dir / "RESULTS.md", "a") as f:
        f.write("\n" + section)
    return target_png
