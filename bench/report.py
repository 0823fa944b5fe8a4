"""compare.py's outputs: the markdown section (for the dated log, bench/log/RESULTS-history.md;
bench/RESULTS.md keeps the latest figures of each benchmark, updated by hand), the short table it
prints last, and the PNG chart."""
from collections import defaultdict
from pathlib import Path

from peers import CUDNN, FA4, IMPLEMENTATIONS, PEERS

COLOURS = {"jagflash": "#d62728", "FA2 varlen": "#1f77b4", "FA3 varlen": "#ff7f0e", "varlen_attn": "#9ecae1",
           "FlexAttention": "#2ca02c", CUDNN: "#9467bd", FA4: "#8c564b"}
KERNEL_TIME_MARK = "³"  # a figure from the GPU kernels' time in the profiler, not from events
SKIPPED_MARK = "⁴"


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


# Issue 13's backward bar: jagflash's backward TFLOP/s above FA2 varlen's on each of the 20 cases
# (five distributions x two masks x D = 128 / 64).
BWD_CASES = 20
# Issue 14's backward bars, jagflash / FA3 varlen in the same run: >= 1.2 on each D = 128 case,
# >= 1.5 on short (both masks) at D = 128, >= 1.0 on each D = 64 case.
FA3_BWD_BARS = ((128, None, 1.2), (128, "short", 1.5), (64, None, 1.0))  # (head dim, dist or all, bar)
# ... and a training step (forward + backward, gemskew, D = 128, both masks) >= 1.15x FA3's.
FA3_STEP_BAR = 1.15


def fa3_backward_bar(dist, head_dim):
    """The strictest of issue 14's backward bars for a case (None: the case has none)."""
    bars = [bar for d, only, bar in FA3_BWD_BARS if d == head_dim and only in (None, dist)]
    return max(bars, default=None)


def _ratio(mine, theirs):
    """(text with both figures, ratio or None): '412.0 / 258.0 = 1.60', or '—' when one is missing."""
    if not mine or not theirs:
        return "—", None
    return f"{mine:.1f} / {theirs:.1f} = {mine / theirs:.2f}", mine / theirs


def _verdict(ratio, bar, strict=False):
    if ratio is None:
        return "—"
    met = ratio > bar if strict else ratio >= bar
    return "**yes**" if met else f"no ({(ratio / bar - 1) * 100:+.0f}%)"


def backward_ratios(rows):
    """{(dist, mask, head_dim): (jagflash bwd, FA2 bwd, FA3 bwd)} TFLOP/s (None where missing),
    for the cases whose jagflash backward was timed."""
    out = {}
    for key, impls in _by_case(rows).items():
        mine = _tflops(impls.get("jagflash"), "bwd")
        if mine is not None:
            out[key] = (mine, _tflops(impls.get("FA2 varlen"), "bwd"), _tflops(impls.get("FA3 varlen"), "bwd"))
    return out


def _steps_by_mask(steps):
    """{mask: {impl: step row}} of the training steps, in the order run."""
    by_mask = defaultdict(dict)
    for row in steps:
        by_mask[row["mask"]][row["impl"]] = row
    return dict(by_mask)


def _step_tflops(impls, name):
    return _tflops(impls.get(name), "step")


def bar_counts(rows, steps):
    """[(bar, met, measured)] for issue 13's bar and each of issue 14's, in this run."""
    ratios = backward_ratios(rows)
    fa2 = [mine / theirs for mine, theirs, _ in ratios.values() if theirs]
    counts = [(f"issue 13: jagflash bwd > FA2 varlen bwd (all {BWD_CASES} cases)", sum(r > 1.0 for r in fa2),
               len(fa2))]
    for head_dim, only, bar in FA3_BWD_BARS:
        fa3 = [mine / theirs for (dist, _, d), (mine, _, theirs) in ratios.items()
               if theirs and d == head_dim and only in (None, dist)]
        what = f"{only}, D = {head_dim}" if only else f"every D = {head_dim} case"
        counts.append((f"issue 14: jagflash / FA3 varlen bwd >= {bar} ({what})", sum(r >= bar for r in fa3), len(fa3)))
    step = [_ratio(_step_tflops(impls, "jagflash"), _step_tflops(impls, "FA3 varlen"))[1]
            for impls in _steps_by_mask(steps).values()]
    step = [r for r in step if r is not None]
    counts.append((f"issue 14: training step jagflash / FA3 varlen >= {FA3_STEP_BAR}",
                   sum(r >= FA3_STEP_BAR for r in step), len(step)))
    return counts


def backward_bar_table(rows):
    """Per case with jagflash's backward timed: its backward TFLOP/s over FA2 varlen's (issue 13:
    above 1) and over FA3 varlen's (issue 14's bar for the case), both figures each; None when
    no case has jagflash's backward."""
    ratios = backward_ratios(rows)
    if not ratios:
        return None
    lines = ["| case | jagflash / FA2 varlen | > 1? | jagflash / FA3 varlen | bar | met? |",
             "|---|---|---|---|---|---|"]
    for (dist, mask, head_dim), (mine, fa2, fa3) in ratios.items():
        fa2_text, fa2_ratio = _ratio(mine, fa2)
        fa3_text, fa3_ratio = _ratio(mine, fa3)
        bar = fa3_backward_bar(dist, head_dim)
        lines.append(f"| {dist} {mask}, D = {head_dim} | {fa2_text} | {_verdict(fa2_ratio, 1.0, strict=True)} | "
                     f"{fa3_text} | {'—' if bar is None else f'{bar:.2f}'} | "
                     f"{'—' if bar is None else _verdict(fa3_ratio, bar)} |")
    return "\n".join(lines) + "\n"


def step_table(steps):
    """The training steps: each implementation's step ms and TFLOP/s (3.5x the forward's FLOPs),
    jagflash / FA2 and / FA3 with both figures, and issue 14's bar (None without steps)."""
    if not steps:
        return None
    lines = ["| training step | jagflash | FA2 varlen | FA3 varlen | jagflash / FA2 | jagflash / FA3 | bar | met? |",
             "|---|---|---|---|---|---|---|---|"]
    for mask, impls in _steps_by_mask(steps).items():
        first = next(iter(impls.values()))
        cells = []
        for name in ("jagflash", "FA2 varlen", "FA3 varlen"):
            row = impls.get(name)
            if row is None:
                cells.append("—")
            elif row.get("error"):
                cells.append("error¹")
            else:
                cells.append(f"{row['step_ms']:.3f} ms, {row['step_tflops']:.1f}")
        mine = _step_tflops(impls, "jagflash")
        fa2_text, _ = _ratio(mine, _step_tflops(impls, "FA2 varlen"))
        fa3_text, fa3_ratio = _ratio(mine, _step_tflops(impls, "FA3 varlen"))
        lines.append(f"| {first['dist']} {mask}, D = {first['head_dim']} | {' | '.join(cells)} | {fa2_text} | "
                     f"{fa3_text} | {FA3_STEP_BAR:.2f} | {_verdict(fa3_ratio, FA3_STEP_BAR)} |")
    return "\n".join(lines) + "\n"


def short_table(rows, steps):
    """What compare.py prints last: per case, the backward TFLOP/s of jagflash, FA2 and FA3, the
    two ratios and whether issue 13's and 14's bars are met; the training steps; the counts."""
    def number(value, digits=1):
        return "—" if value is None else f"{value:.{digits}f}"

    def ratio(mine, theirs):
        return mine / theirs if mine and theirs else None

    lines = ["| case | jagflash | FA2 | FA3 | /FA2 | /FA3 | bars 13 / 14 |", "|---|---|---|---|---|---|---|"]
    for (dist, mask, head_dim), (mine, fa2, fa3) in backward_ratios(rows).items():
        to_fa2, to_fa3, bar = ratio(mine, fa2), ratio(mine, fa3), fa3_backward_bar(dist, head_dim)
        met13 = "—" if to_fa2 is None else ("yes" if to_fa2 > 1.0 else "no")
        met14 = "—" if to_fa3 is None or bar is None else ("yes" if to_fa3 >= bar else "no")
        lines.append(f"| bwd {dist} {mask} D{head_dim} | {number(mine)} | {number(fa2)} | {number(fa3)} | "
                     f"{number(to_fa2, 2)} | {number(to_fa3, 2)} | {met13} / {met14} |")
    for mask, impls in _steps_by_mask(steps).items():
        mine, fa2, fa3 = (_step_tflops(impls, name) for name in ("jagflash", "FA2 varlen", "FA3 varlen"))
        to_fa3 = ratio(mine, fa3)
        met14 = "—" if to_fa3 is None else ("yes" if to_fa3 >= FA3_STEP_BAR else "no")
        first = next(iter(impls.values()))
        lines.append(f"| step {first['dist']} {mask} D{first['head_dim']} | {number(mine)} | {number(fa2)} | "
                     f"{number(fa3)} | {number(ratio(mine, fa2), 2)} | {number(to_fa3, 2)} | — / {met14} |")
    lines.append("Bars met in this run (cases met of cases measured):")
    lines += [f"- {what}: " + (f"{met} of {measured}" if measured else "not measured")
              for what, met, measured in bar_counts(rows, steps)]
    return "\n".join(lines)


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
    if row.get("skipped"):
        return "skipped" + SKIPPED_MARK
    fwd, bwd = (_tflops(row, direction) for direction in ("fwd", "bwd"))
    mark = ("²" if row.get("mismatch") else "") + (KERNEL_TIME_MARK if row.get("timer") == "profiler" else "")
    return " / ".join("—" if t is None else f"{t:.1f}" for t in (fwd, bwd)) + mark


def ratio_to_best_peer(impls, direction):
    """jagflash's TFLOP/s over the best peer's in this case (None when either is missing)."""
    mine = _tflops(impls.get("jagflash"), direction)
    peers = [t for t in (_tflops(impls.get(p), direction) for p in PEERS) if t]
    return mine / max(peers) if mine and peers else None


def _ratio_cell(impls):
    parts = [ratio_to_best_peer(impls, d) for d in ("fwd", "bwd")]
    return " / ".join("—" if r is None else f"{r:.3f}" for r in parts)


def table(rows):
    # cuDNN's and FA4's columns only in runs that asked for them (they are not in the default run).
    names = [name for name in IMPLEMENTATIONS
             if name not in (CUDNN, FA4) or any(r["impl"] == name for r in rows)]
    head = "| dist | mask | D | " + " | ".join(names) + " | jagflash / best peer |"
    lines = [head, "|" + "---|" * (len(names) + 4)]
    for (dist, mask, head_dim), impls in _by_case(rows).items():
        cells = " | ".join(_cell(impls.get(name)) for name in names)
        lines.append(f"| {dist} | {mask} | {head_dim} | {cells} | {_ratio_cell(impls)} |")
    return "\n".join(lines)


def _method_note(meta):
    """How the runs were timed. The log's oldest runs (no bwd_calls in meta) timed only the
    forward in turns, and one backward call per run, each implementation after the other."""
    if "bwd_calls" not in meta:
        turns = meta.get("fwd_order") == "interleaved"
        return (f"a forward run is {meta.get('fwd_calls', 1)} call(s) queued back to back, per call) after "
                f"warm-up, capped at {meta['budget_s']} s per measurement"
                + ("; the implementations' forward runs taken in turns (one run each per round, the order "
                   "reversed every other round)" if turns else "; each implementation's forward runs after the "
                   "previous one's") + "; a backward run is one call, each implementation's after the previous one's")
    order = ("the implementations' runs taken in turns (one run each per round, the order reversed every other "
             "round), forward and backward alike" if meta.get("order") == "interleaved" else
             "each implementation's runs after the previous one's")
    return (f"a run is {meta['fwd_calls']} forward call(s) or {meta['bwd_calls']} backward call(s) or training "
            f"step(s) queued back to back, per call) after {meta.get('warmup', 'a')} warm-up run(s), an "
            f"implementation's runs capped at {meta['budget_s']} s per measurement; {order}")


def _where(row):
    """A row's case as text: compare.py's rows name a distribution, sweep.py's a case."""
    return f"{row.get('dist', row.get('case'))}/{row['mask']}/D{row['head_dim']}"


def kernel_timed_note(meta, rows):
    """The caption's sentence on the profiler-timed implementation (cuDNN ragged), from its rows:
    how it was timed and why, what its calls cost on the wall clock, and how its output compared
    with the reference's before it was timed (None when no row of it was timed)."""
    timed = [r for r in rows if r.get("timer") == "profiler" and not r.get("error")]
    if not timed:
        return None
    names = ", ".join(dict.fromkeys(r["impl"] for r in timed))
    wall = sorted(r["wall_ms"] for r in timed if r.get("wall_ms") is not None)
    kernel = sorted(r["fwd_ms"] for r in timed if r.get("fwd_ms") is not None)
    text = (f"{KERNEL_TIME_MARK} {names}: torch's nested-tensor SDPA (jagged q, k, v as [B, H, j, D]) with "
            "TORCH_CUDNN_SDPA_NESTED_TENSOR_ENABLED=1 and sdpa_kernel(CUDNN_ATTENTION), cuDNN "
            f"{meta.get('cudnn', '?')}; forward only (its ragged backward returns wrong dq / dk in torch 2.11, "
            "PyTorch PR 186142). Its time is the sum of the CUDA kernel times of one call in torch.profiler, "
            f"the median of {meta.get('iters', '?')} calls, not CUDA events around queued calls as for the "
            "others: torch rebuilds its cuDNN graph on every call and spends tens of ms on the host")
    if wall and kernel:
        text += (f" (here {wall[0]:.1f}–{wall[-1]:.1f} ms a call on the wall clock, against "
                 f"{kernel[0]:.2f}–{kernel[-1]:.2f} ms of kernels)")
    text += (". So its figure leaves out launch gaps and host work that the event-timed figures include, "
             "and its kernels run on a GPU that idles between calls")
    abs_errs = [(r["max_abs_err"], r) for r in timed if r.get("max_abs_err") is not None]
    if abs_errs:
        worst, r = max(abs_errs, key=lambda pair: pair[0])
        against = ", ".join(sorted({t.get("checked_against", "jagflash") for t in timed}))
        text += (f". Its output was checked against {against}'s before it was timed: max abs error at most "
                 f"{worst:.3g} ({_where(r)})")
    return text + "."


def skipped_notes(rows):
    """One line per (implementation, reason) of the cases skipped, with the cases."""
    by_reason = defaultdict(list)
    for r in rows:
        if r.get("skipped"):
            by_reason[(r["impl"], r["skipped"])].append(_where(r))
    return [f"{SKIPPED_MARK} {impl} skipped on {', '.join(cases)}: {reason}"
            for (impl, reason), cases in by_reason.items()]


def markdown(meta, rows, png_name, steps=()):
    steps = list(steps)
    errors = sorted({(r["impl"], r["error"]) for r in rows + steps if r.get("error")})
    mismatches = [r for r in rows if r.get("mismatch")]
    skipped = meta.get("skipped", {})
    parts = meta.get("parts", ["fwd", "bwd"])
    lines = [
        f"## {meta['date']} — side by side with FlashAttention and PyTorch's kernels (commit {meta['commit']})",
        "",
        f"Command: `{meta['command']}`. {meta['gpu']}; torch {meta['torch']} (CUDA {meta['cuda']}), "
        f"Triton {meta['triton']}, Python {meta['python']}, jagflash library {meta['jagflash']} "
        f"(default backend).",
        "",
        f"{meta['dtype']}, H = {meta['heads']}, self-attention on {', '.join(meta['dists'])} "
        f"(shared/bench/distributions.md, seed {meta['seed']}{meta['scale_note']}); TFLOP/s of useful work, forward / backward "
        f"(forward 4·H·D·visible pairs, backward 2.5×, training step 3.5×), "
        f"median of up to {meta['iters']} timed runs "
        f"({meta['timer']}; {_method_note(meta)}; all in one process on the same inputs"
        + ("" if "fwd" in parts else "; forwards not timed (each run once for its backward)")
        + ". FlexAttention runs compiled, on copies padded to one common "
        "length (so it compiles once per head dim and mask) with a document block mask that lists "
        "no padding block. Backward: jagflash, FA3 (flash_attn_interface.flash_attn_varlen_func), varlen_attn "
        "and FlexAttention through autograd, FA2 through aten._flash_attention_backward.",
    ]
    if rows:
        lines += ["", table(rows), "", f"![jagflash and peers, TFLOP/s]({png_name})"]
    bars = bar_table(rows)
    if bars:
        lines += ["", "Forward bar (issue 4: jagflash / FA2 against FA3 / FA2 of shared/bench/distributions.md; "
                  "1.5x that on short):", "", bars.rstrip("\n")]
    bwd_bars = backward_bar_table(rows)
    if bwd_bars:
        lines += ["", "Backward bars, TFLOP/s in this run: issue 13, jagflash above FA2 varlen on all "
                  f"{BWD_CASES} cases; issue 14, jagflash / FA3 varlen >= 1.2 at D = 128, >= 1.5 on short at "
                  "D = 128, >= 1.0 at D = 64 (a bar counts when two runs meet it):", "", bwd_bars.rstrip("\n")]
    steps_text = step_table(steps)
    if steps_text:
        lines += ["", "Training step (forward + backward of the attention, through autograd for jagflash and FA3, "
                  f"aten for FA2; ms and TFLOP/s per step; issue 14's bar: jagflash >= {FA3_STEP_BAR}x FA3):", "",
                  steps_text.rstrip("\n")]
    if bwd_bars or steps_text:
        lines += [""] + [f"- {what}: " + (f"met on {met} of {measured} cases measured" if measured else
                                          "no case measured in this run")
                         for what, met, measured in bar_counts(rows, steps)]
    notes = []
    for impl, reason in skipped.items():
        notes.append(f"{impl} not in this run: {reason}.")
    for impl, error in errors:
        notes.append(f"¹ {impl}: {error}")
    kernel_note = kernel_timed_note(meta, rows)
    if kernel_note:
        notes.append(kernel_note)
    notes += skipped_notes(rows)
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
    impls = [name for name in IMPLEMENTATIONS if any(r["impl"] == name for r in rows)]  # those in the run
    head_dims = sorted({k[2] for k in cases}, reverse=True)
    fig, axes = plt.subplots(2, len(head_dims), figsize=(9 * len(head_dims), 9), squeeze=False)
    width = 0.8 / len(impls)
    for col, head_dim in enumerate(head_dims):
        keys = [k for k in cases if k[2] == head_dim]
        labels = [f"{dist}\n{mask}" for dist, mask, _ in keys]
        for row_index, direction in enumerate(("fwd", "bwd")):
            ax = axes[row_index][col]
            for i, impl in enumerate(impls):
                values = [_tflops(cases[k].get(impl), direction) or 0.0 for k in keys]
                positions = [x + (i - (len(impls) - 1) / 2) * width for x in range(len(keys))]
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
    fig.legend(handles, labels, loc="lower center", ncol=len(impls),
               title="× over a jagflash bar: jagflash / best peer", title_fontsize=8)
    fig.suptitle(f"jagflash vs FlashAttention and PyTorch kernels — {meta['gpu']}, {meta['dtype']}, "
                 f"H = {meta['heads']}, {meta['date']}, commit {meta['commit']}")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


HISTORY = Path("log") / "RESULTS-history.md"  # the dated log, under bench/


def append_results(section, png_path, bench_dir):
    """Appends the section to the dated log (bench/log/RESULTS-history.md) and puts the chart in
    bench/, beside bench/RESULTS.md (the current standing, which is brought up to date by hand).
    The section's link to the chart is made relative to the log's folder. Returns (the log's path,
    the chart's path or None)."""
    bench_dir = Path(bench_dir)
    target_png = None
    if png_path is not None:
        target_png = bench_dir / Path(png_path).name
        if Path(png_path).resolve() != target_png.resolve():
            target_png.write_bytes(Path(png_path).read_bytes())
        section = section.replace(f"]({target_png.name})", f"](../{target_png.name})")
    history = bench_dir / HISTORY
    with open(history, "a") as f:
        f.write("\n" + section)
    return history, target_png
