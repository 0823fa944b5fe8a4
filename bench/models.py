#!/usr/bin/env python3
"""One attention layer of real models, jagflash beside every peer: the table to read before choosing.

Each model's layer (its heads, head dims, mask, window, softcap, sinks) on the batch it trains on:
document-packed text (sweep.py's "docpack": log-normal document lengths around 900, clipped to
[64, 8192], --tokens a batch) for the language models, skewed user histories (the shared
generator's gemskew) for the recsys model. Forward, backward, and the training step (forward +
backward through autograd), in TFLOP/s of useful work and ms, jagflash beside FA3 varlen, FA4
varlen (FlashAttention-4), FA2 varlen (aten), cuDNN (torch's nested-tensor SDPA, forward only)
and FlexAttention (compiled, with the same mask, window, softcap and sinks). A peer that lacks
a layer's feature says so in words ("no softcap", "no sinks", "no D=256") in its cell; where
jagflash runs a layer off its Hopper kernels (the backward of D = 256 with a softcap: its GPU
oracle), a note says so.

    Llama-3-8B        32 / 8 heads, D = 128, causal
    Qwen2.5-7B        28 / 4 heads, D = 128, causal
    gpt-oss           64 / 8 heads, D = 64, causal with sinks; causal window 128 with sinks
    Gemma-2-9B        16 / 8 heads, D = 256, softcap 50, causal; causal window 4096
    DeepSeek-V3 MLA   D = 192 for q, k, Dv = 128, causal; --mla-heads of its 128 heads (16)
    recsys            16 heads, D = 128 on gemskew histories: no mask, causal, and pooled (one
                      shared query set of --pooled-rows rows per history)

A window of W: each query sees itself and the W - 1 keys before it (Hugging Face's sliding_window
= W; FlashAttention's window_size (W - 1, 0)). Sinks: one fp32 logit per query head in every row's
softmax denominator (gpt-oss; FA4's learnable_sink; FlexAttention gets them through its lse, see
peers.FlexAttention); jagflash takes them where its build has learnable_sink=. Pooled: jagflash's
pooled_attention takes the query set once; the peers take it repeated per sequence, made once
outside their timed calls (the repeat and the sum of dq over the copies are timed apart and
given in a note).

Timing as compare.py's: each implementation warmed up, then samples taken in turns (the order
reversed every other round), a sample --fwd-calls forwards or --bwd-calls backwards / steps queued
between two CUDA events, the median per call; cuDNN by its kernels in torch.profiler
(compare.check_then_profile). FLOPs as compare.py's, from the visible pairs under the mask and
window (jagflash.visible_pairs): forward 2·H·pairs·(D + Dv) (4·H·D·pairs when Dv = D), backward
2·H·pairs·(3·D + 2·Dv) (2.5 times the forward's when Dv = D), the step both. Every peer's output
and gradients are compared with jagflash's (or, where jagflash did not run, the first peer's):
max |difference| in the check table, over compare.MISMATCH_TOL (normalised) marked.

    python bench/models.py                                    # on the GPU machine: every model
    python bench/models.py --models llama3-8b qwen2.5-7b gpt-oss --out A   # one device call ...
    python bench/models.py --models gemma2-9b deepseek-v3 recsys --out B   # ... and another
    python bench/models.py --from A B --update-results        # here: one table; bench/RESULTS.md
    python bench/models.py --device cpu --scale 32 --iters 1 --warmup 0   # a smoke run, no GPU

On the GPU machine scripts/gpu-models.sh runs it from a carried build (MODELS_ARGS="--models ...")
with FA3 when its prebuilt copy is carried as .fa3/ and FA4 when installed in /tmp/site
(../shared/peers/fa4/README.md); a peer that does not import is left out with a note.
FlexAttention compiles each layer's kernels (tens of seconds each): split the models over device
calls as above to stay inside one call's 10 minutes.

Writes models.json (every number), models.md (the section: the table, the check table, notes)
and models-DATE-COMMIT.png (jagflash / the best peer per layer and direction) into --out (default
$OUT, else bench/out), and prints the table. --update-results puts the section in bench/RESULTS.md
(its "One layer of real models" section) and appends it to bench/log/RESULTS-history.md.
"""
import argparse
import dataclasses
import functools
import gc
import json
import os
import sys
import textwrap
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
import sweep  # noqa: E402

MODELS = ("llama3-8b", "qwen2.5-7b", "gpt-oss", "gemma2-9b", "deepseek-v3", "recsys")  # --models
GPU_IMPLS = ("jagflash", "FA3 varlen", peers.FA4, "FA2 varlen", peers.CUDNN, "FlexAttention")
CPU_IMPLS = ("jagflash", "FlexAttention")  # what runs on CPU tensors (FlexAttention: its forward)
PARTS = ("fwd", "bwd", "step")
PART_NAMES = {"fwd": "forward", "bwd": "backward", "step": "fwd + bwd"}
RESULTS_SECTION = "One layer of real models beside every peer"
ERROR_MARK, MISMATCH_MARK = "¹", "²"


@dataclasses.dataclass(frozen=True)
class Layer:
    """One attention layer of a model, as it runs in training."""
    id: str
    model: str  # the --models key: every layer kind of a model runs together
    name: str
    kind: str  # the layer kind, in words
    heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    batch: str  # "docpack", or one of jagflash.DISTRIBUTIONS
    causal: bool
    window: int = 0  # a sliding window of this many keys (the query's own included); 0: none
    softcap: float = 0.0
    sinks: bool = False
    pooled: int = 0  # rows of the shared query set; 0: self-attention
    model_heads: int = 0  # the model's query heads where the run takes fewer (DeepSeek's 128); 0: heads


def layers(args):
    """Every layer of the run's models, in the table's order."""
    mla = args.mla_heads
    hist, lq = args.histories, args.pooled_rows
    all_layers = [
        Layer("llama3-8b", "llama3-8b", "Llama-3-8B", "causal", 32, 8, 128, 128, "docpack", True),
        Layer("qwen2.5-7b", "qwen2.5-7b", "Qwen2.5-7B", "causal", 28, 4, 128, 128, "docpack", True),
        Layer("gpt-oss-full", "gpt-oss", "gpt-oss", "causal, sinks", 64, 8, 64, 64, "docpack", True, sinks=True),
        Layer("gpt-oss-sliding", "gpt-oss", "gpt-oss", "causal window 128, sinks", 64, 8, 64, 64, "docpack", True,
              window=128, sinks=True),
        Layer("gemma2-9b-global", "gemma2-9b", "Gemma-2-9B", "causal, softcap 50", 16, 8, 256, 256, "docpack", True,
              softcap=50.0),
        Layer("gemma2-9b-local", "gemma2-9b", "Gemma-2-9B", "causal window 4096, softcap 50", 16, 8, 256, 256,
              "docpack", True, window=4096, softcap=50.0),
        Layer("deepseek-v3-mla", "deepseek-v3", "DeepSeek-V3 MLA", "causal", mla, mla, 192, 128, "docpack", True,
              model_heads=128),
        Layer("recsys-none", "recsys", "recsys history", "no mask", 16, 16, 128, 128, hist, False),
        Layer("recsys-causal", "recsys", "recsys history", "causal", 16, 16, 128, 128, hist, True),
        Layer("recsys-pooled", "recsys", "recsys history", f"pooled, Lq = {lq}", 16, 16, 128, 128, hist, False,
              pooled=lq),
    ]
    return [scaled(layer, args.scale) for layer in all_layers if layer.model in args.models]


def scaled(layer, scale):
    """The layer with 1/scale of its KV heads (at least one), each with its group of query heads
    (GQA stays GQA): a smoke run's tiny shapes."""
    if scale == 1:
        return layer
    kv_heads = max(1, layer.kv_heads // scale)
    return dataclasses.replace(layer, kv_heads=kv_heads, heads=kv_heads * (layer.heads // layer.kv_heads))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", str(HERE / "out")))
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--impls", nargs="+", default=None, choices=peers.IMPLEMENTATIONS, type=peers.impl_name,
                   help="default: %s on CUDA, %s on the CPU; _ for spaces also: FA3_varlen"
                        % (", ".join(GPU_IMPLS), ", ".join(CPU_IMPLS)))
    p.add_argument("--tokens", type=int, default=131072, help="tokens of a document-packed batch")
    p.add_argument("--histories", default="gemskew", choices=jagflash.DISTRIBUTIONS,
                   help="the recsys model's user histories (the shared generator's lengths)")
    p.add_argument("--pooled-rows", type=int, default=32, help="Lq of the recsys model's pooled layer")
    p.add_argument("--mla-heads", type=int, default=16, help="DeepSeek-V3 MLA's heads (it has 128)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--scale", type=int, default=1,
                   help="keep 1/N of each batch's sequences, each 1/N as long, and 1/N of the KV heads "
                        "(smoke runs)")
    p.add_argument("--seed", type=int, default=jagflash.DEFAULT_SEED)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--fwd-calls", type=int, default=4)
    p.add_argument("--bwd-calls", type=int, default=2)
    p.add_argument("--budget-s", type=float, default=1.0)
    p.add_argument("--commit", default=None, help="commit measured (default: $JAGFLASH_COMMIT, else git)")
    p.add_argument("--from", dest="from_dirs", nargs="+", default=None,
                   help="render the models.json of these folders as one table; run nothing")
    p.add_argument("--update-results", action="store_true",
                   help="put the section in bench/RESULTS.md and append it to bench/log/RESULTS-history.md")
    args = p.parse_args(argv)
    args.command = "python bench/models.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.impls is None:
        args.impls = list(GPU_IMPLS if torch.device(args.device).type == "cuda" else CPU_IMPLS)
    # What compare.environment(), compare.measure_all() and compare.check_then_profile() read.
    args.order, args.dtype, args.heads, args.dists, args.max_batch = "interleaved", "bf16", "per layer", [], 0
    args.parts = list(PARTS)
    return args


def batch_lengths(layer, args):
    """The layer's batch: docpack at --tokens, or the named distribution; --scale keeps 1/N of the
    sequences (at least two, so that documents still have neighbours), each 1/N as long."""
    if layer.batch == "docpack":
        lengths = sweep.own_lengths("docpack", args.tokens)
    else:
        lengths = jagflash.generate_lengths(layer.batch, args.seed)
    if args.scale > 1:
        lengths = [max(1, n // args.scale) for n in lengths[: max(2, len(lengths) // args.scale)]]
    return lengths


def visible_pairs(layer, lengths):
    """The (query, key) pairs the layer computes on the batch (a pooled layer: Lq queries a sequence)."""
    window = (layer.window - 1, 0) if layer.window else (-1, -1)
    return sum(jagflash.visible_pairs(layer.pooled or n, n, causal=layer.causal, window=window) for n in lengths)


def useful_flops(layer, pairs):
    """{part: FLOPs} of the layer: the GEMMs' work on the visible pairs (compare.py's count, with
    q·k at D and p·v at Dv: forward QK^T and PV; backward QK^T, dO·V^T, P^T·dO, dS^T·Q, dS·K)."""
    d, dv = layer.head_dim, layer.v_head_dim
    fwd = 2.0 * layer.heads * pairs * (d + dv)
    bwd = 2.0 * layer.heads * pairs * (3 * d + 2 * dv)
    return {"fwd": fwd, "bwd": bwd, "step": fwd + bwd}


def layer_inputs(layer, lengths, device, generator):
    """peers.Inputs of the layer: q, k, v, dout from N(0, 1) in bf16 (compare.py's draw), the sinks
    fp32 N(0, 1), all leaves that require grad; pooled, q is the [Lq, H, D] query set."""
    def draw(rows, heads, width):
        return torch.randn((rows, heads, width), generator=generator, device=device).to(torch.bfloat16)

    total = sum(lengths)
    q_lengths = [layer.pooled] * len(lengths) if layer.pooled else None
    q = draw(layer.pooled or total, layer.heads, layer.head_dim).requires_grad_()
    k = draw(total, layer.kv_heads, layer.head_dim).requires_grad_()
    v = draw(total, layer.kv_heads, layer.v_head_dim).requires_grad_()
    dout = draw(sum(q_lengths) if layer.pooled else total, layer.heads, layer.v_head_dim)  # out's rows
    sinks = None
    if layer.sinks:
        sinks = torch.randn((layer.heads,), generator=generator, device=device).requires_grad_()
    return peers.Inputs(q, k, v, dout, peers.offsets_of(lengths, device), lengths, layer.causal,
                        -(-total // 128) * 128, q_lengths=q_lengths,
                        q_offsets=peers.offsets_of(q_lengths, device) if q_lengths else None,
                        window_left=layer.window - 1 if layer.window else -1, softcap=layer.softcap, sinks=sinks,
                        query_set=bool(layer.pooled))


def build(names, x, compile_flex):
    """({name: implementation}, {name: peers.Skip or exception}) for the layer."""
    impls, refused = {}, {}
    for name in names:
        try:
            impls[name] = peers.make(name, x, compile_flex=compile_flex)
        except Exception as e:  # noqa: BLE001 - a peer that cannot run this layer must not stop the others
            refused[name] = e
    return impls, refused


def time_layer(impls, device, args):
    """{name: {part_ms, out, grads, part: exception or Skip}}: forwards timed in turns, the
    profiler-timed ones (cuDNN) checked against them and timed; then the backwards through each
    forward's output; then training steps. Unlike compare.time_case, a backward that fails or does
    not exist (impl.no_backward) leaves the forward's figure standing."""
    results = {name: {} for name in impls}
    profiled = {n: i for n, i in impls.items() if getattr(i, "timer", None) == "profiler"}
    evented = {n: i for n, i in impls.items() if n not in profiled}
    for name, r in compare.measure_all({n: i.forward for n, i in evented.items()}, device, args,
                                       args.fwd_calls).items():
        results[name].update({"fwd": r} if isinstance(r, Exception) else {"fwd_ms": r[0], "out": r[1]})
    reference = compare.reference_output(list(impls), {n: {"impl": evented[n], "out": results[n].get("out")}
                                                       for n in evented})
    for name, impl in profiled.items():
        r = compare.check_then_profile(impl, reference, device, args)
        results[name].update({"fwd": r} if isinstance(r, Exception) else r)
    del reference
    trainable = {}
    for name, impl in evented.items():
        if getattr(impl, "no_backward", None):
            results[name]["bwd"] = results[name]["step"] = peers.Skip(impl.no_backward)
        elif "out" in results[name]:
            trainable[name] = impl
        else:  # its forward's error is in the forward's cell
            results[name]["bwd"] = results[name]["step"] = peers.Skip("no forward")
    backwards = {n: functools.partial(i.backward, results[n]["out"]) for n, i in trainable.items()}
    for name, r in compare.measure_all(backwards, device, args, args.bwd_calls).items():
        results[name].update({"bwd": r} if isinstance(r, Exception) else {"bwd_ms": r[0], "grads": r[1]})
    for name, impl in profiled.items():
        results[name]["bwd"] = results[name]["step"] = peers.Skip(impl.no_backward)
    return results, trainable


def time_steps(trainable, results, device, args):
    """Adds each implementation's training step (its forward, then the backward through it once)."""
    steps = {n: i.step for n, i in trainable.items() if "bwd_ms" in results[n]}
    for name, r in compare.measure_all(steps, device, args, args.bwd_calls).items():
        results[name].update({"step": r} if isinstance(r, Exception) else {"step_ms": r[0]})
    for name in trainable:
        if "step_ms" not in results[name] and "step" not in results[name]:
            results[name]["step"] = peers.Skip("no backward")  # its backward's error is in the backward's cell


def comparable(impl, result):
    """(out, *grads) of an implementation, unpadded (and pooled dq folded), detached."""
    out, grads = impl.unpad(result["out"], result.get("grads", ()))
    return tuple(t.detach() for t in (out, *grads))


def check(row, mine, reference):
    """max abs and normalised difference of out and gradients from the reference's, on the tensors
    both have (a forward-only peer: out; shapes differing: not compared)."""
    pairs = [(a, b) for a, b in zip(mine, reference) if a.shape == b.shape]
    if pairs:
        row["max_abs_err"] = max(compare.max_abs_error(a, b) for a, b in pairs)
        row["max_err"] = max(compare.normalised_error(a, b) for a, b in pairs)
        row["mismatch"] = not row["max_err"] <= compare.MISMATCH_TOL  # NaN too


def part_cell_fields(row, part, result, flops):
    """A part's figures, or why it has none, into the row."""
    outcome = result.get(part)
    if isinstance(outcome, peers.Skip):
        row[f"{part}_skipped"] = str(outcome)
    elif isinstance(outcome, Exception):
        row[f"{part}_error"] = compare._error_text(outcome)
    elif result.get(f"{part}_ms") is not None:
        row[f"{part}_ms"] = result[f"{part}_ms"]
        row[f"{part}_tflops"] = flops[part] / result[f"{part}_ms"] / 1e9


def layer_rows(names, impls, refused, results, flops, where):
    """One row per implementation: figures per part, the check against the reference, notes."""
    compared = {n: comparable(impls[n], results[n]) for n in names if "out" in results.get(n, {})}
    # The reference: jagflash's results, else the first peer's with gradients (a forward-only
    # peer's out would leave the others' gradients unchecked).
    candidates = sorted(compared, key=lambda n: (n != "jagflash", len(compared[n]) == 1))
    reference_name = candidates[0] if candidates else None
    reference, rows = compared.get(reference_name), []
    for name in names:
        row = {"impl": name, **where}
        if isinstance(refused.get(name), peers.Skip):
            row["skipped"] = str(refused[name])
        elif name in refused:
            row["error"] = compare._error_text(refused[name])
        else:
            for part in PARTS:
                part_cell_fields(row, part, results[name], flops)
            row.update({key: results[name][key] for key in compare.PROFILED_FIELDS if key in results[name]})
            if getattr(impls[name], "note", None):
                row["note"] = impls[name].note
            if name in compared and name != reference_name:
                check(row, compared[name], reference)
                row["checked_against"] = reference_name
        rows.append(row)
    return rows


def jagflash_paths(x, layer):
    """Where jagflash's forward and backward ran, where not on its Hopper kernels (None: there, or
    not known: pooled, the CPU, or a build that refuses the layer)."""
    if not x.q.is_cuda or layer.pooled:
        return None
    paths = []
    for backward in (False, True):
        try:
            served = jagflash.backend(x.q, x.k, x.v, x.cu_q, backward=backward, softcap=x.softcap or None)
        except Exception:  # noqa: BLE001 - the call itself reports its refusal in the table
            return None
        if served != "hopper":
            where = "GPU oracle (slow)" if served == "oracle" else served
            paths.append(f"{'backward' if backward else 'forward'} on its {where}")
    return ", ".join(paths) or None


def pooled_repeat_ms(x, device, args):
    """(ms of the query set repeated per sequence, ms of dq summed over the copies): what a peer
    given the repeated queries pays beyond its timed calls."""
    batch = len(x.lengths)
    repeated = x.q.detach().repeat(batch, 1, 1)
    repeat_ms, _ = compare.measure(lambda: x.q.detach().repeat(batch, 1, 1), device, args.warmup, args.iters,
                                   args.budget_s, args.fwd_calls)
    sum_ms, _ = compare.measure(lambda: repeated.unflatten(0, (batch, -1)).sum(0), device, args.warmup,
                                args.iters, args.budget_s, args.fwd_calls)
    return repeat_ms, sum_ms


def run_layer(layer, args, device, generator):
    lengths = batch_lengths(layer, args)
    x = layer_inputs(layer, lengths, device, generator)
    pairs = visible_pairs(layer, lengths)
    flops = useful_flops(layer, pairs)
    # case, mask and head_dim: how report.kernel_timed_note names a row's case.
    where = {"layer": layer.id, "case": layer.id, "mask": layer.kind, "head_dim": layer.head_dim,
             "sequences": len(lengths), "tokens": sum(lengths), "pairs": pairs}
    info = {**dataclasses.asdict(layer), "sequences": len(lengths), "tokens": sum(lengths), "pairs": pairs,
            "jagflash_path": jagflash_paths(x, layer)}
    if layer.pooled:
        info["repeat_ms"], info["dq_sum_ms"] = pooled_repeat_ms(x, device, args)
    impls, refused = build(args.impls, x, compile_flex=device.type == "cuda")
    results, trainable = time_layer(impls, device, args)
    rows = layer_rows(args.impls, impls, refused, results, flops, where)
    for r in results.values():  # the outputs and their graphs, before the steps allocate theirs
        r.pop("out", None)
        r.pop("grads", None)
    time_steps(trainable, results, device, args)
    for row in rows:
        if row["impl"] in results:
            part_cell_fields(row, "step", results[row["impl"]], flops)
    return info, rows


def skip_unavailable(args, meta):
    """compare.skip_unavailable (FA3 that does not import, cuDNN where torch cannot run it), and
    FA4 that does not import."""
    if peers.FA4 in args.impls:
        reason = peers.fa4_import_error()
        if reason is not None:
            meta["skipped"][peers.FA4] = (f"flash_attn.cute does not import ({reason}); install it as "
                                          "../shared/peers/fa4/README.md says")
            args.impls = [name for name in args.impls if name != peers.FA4]
    compare.skip_unavailable(args, meta)


def run(args, out_dir):
    device = torch.device(args.device)
    # Every layer compiles FlexAttention anew (its shapes and mods): more than dynamo's default of
    # 8 compilations of one function, after which it would fall back to eager (a [T, T] score matrix).
    torch._dynamo.config.recompile_limit = 64
    meta = compare.environment(args, device)
    meta.update(command=args.command, columns=list(args.impls),
                tokens=args.tokens, scale=args.scale, layers={})
    skip_unavailable(args, meta)
    meta["impls"] = list(args.impls)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    rows = []
    for layer in layers(args):
        t0 = time.time()
        info, measured = run_layer(layer, args, device, generator)
        meta["layers"][layer.id] = info
        rows += measured
        for row in measured:
            print(progress(row), flush=True)
        print(f"  ({time.time() - t0:.0f} s)", flush=True)
        save(out_dir, meta, rows)
        gc.collect()  # the layer's implementations and graphs, before the next layer allocates
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return meta, rows


def save(out_dir, meta, rows):
    """Rewritten after every layer, so a run cut short still leaves what it measured."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "models.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


def progress(row):
    what = f"{row['layer']:>17} {row['impl']:<14}"
    if row.get("skipped") or row.get("error"):
        return f"{what} {'SKIPPED' if row.get('skipped') else 'ERROR'} {row.get('skipped') or row.get('error')}"
    cells = [f"{part} {cell(row, part)}" for part in PARTS]
    err = f"  max abs diff {row['max_abs_err']:.2g}" if row.get("max_abs_err") is not None else ""
    return f"{what} {' | '.join(cells)}{err}"


def cell(row, part):
    """A table cell: 'TFLOP/s (ms)', or why there is no figure, in words."""
    if row is None:
        return "—"
    for why in (row.get("skipped"), row.get(f"{part}_skipped")):
        if why:
            return why
    if row.get("error") or row.get(f"{part}_error"):
        return "error" + ERROR_MARK
    if row.get(f"{part}_tflops") is None:
        return "—"
    marks = (MISMATCH_MARK if row.get("mismatch") else "") + \
        (report.KERNEL_TIME_MARK if part == "fwd" and row.get("timer") == "profiler" else "")
    tflops = row[f"{part}_tflops"]
    figure = f"{tflops:.0f}" if tflops >= 10 else f"{tflops:.2g}"  # the CPU's smoke runs: a fraction of one
    return f"{figure} ({row[f'{part}_ms']:.2f} ms){marks}"


def best_peer(by_impl, part):
    """(jagflash / the fastest peer, that peer's name), or (None, None) without both figures."""
    mine = (by_impl.get("jagflash") or {}).get(f"{part}_tflops")
    peer_figures = [(r.get(f"{part}_tflops"), n) for n, r in by_impl.items() if n != "jagflash" and
                    r.get(f"{part}_tflops")]
    if not mine or not peer_figures:
        return None, None
    figure, name = max(peer_figures)
    return mine / figure, name


def by_layer(rows):
    """{layer id: {impl: row}} in the order measured."""
    out = {}
    for row in rows:
        out.setdefault(row["layer"], {})[row["impl"]] = row
    return out


def columns(meta, rows):
    """The table's implementations: those asked for (jagflash first), those not run included."""
    names = list(meta.get("columns") or meta["impls"])
    names += [n for n in dict.fromkeys(r["impl"] for r in rows) if n not in names]
    return names


def layer_label(info):
    """(model, layer, batch) of a layer, as the table's first columns give them."""
    heads = f"{info['heads']}/{info['kv_heads']}" if info["kv_heads"] != info["heads"] else f"{info['heads']}"
    if info.get("model_heads") and info["model_heads"] != info["heads"]:
        heads += f" (of its {info['model_heads']})"
    dims = f"D={info['head_dim']}" + (f"/{info['v_head_dim']}" if info["v_head_dim"] != info["head_dim"] else "")
    return info["name"], f"{info['kind']}; H {heads}, {dims}", f"{info['batch']} {info['tokens']} / {info['sequences']}"


def table(meta, rows):
    """Markdown: a row per layer and part; a column per implementation: 'TFLOP/s (ms)' or why not."""
    names = columns(meta, rows)
    lines = ["| model | layer | batch (tokens / seqs) | part | " + " | ".join(names) + " | jagflash / best peer |",
             "|" + "---|" * (len(names) + 5)]
    for layer_id, by_impl in by_layer(rows).items():
        model, kind, batch = layer_label(meta["layers"][layer_id])
        for i, part in enumerate(PARTS):
            cells = [cell(by_impl.get(n), part) if n not in meta.get("skipped", {}) else "not in this run"
                     for n in names]
            ratio, peer = best_peer(by_impl, part)
            versus = "—" if ratio is None else f"{ratio:.2f} ({peer})"
            head = [model, kind, batch] if i == 0 else ["", "", ""]
            lines.append("| " + " | ".join(head + [PART_NAMES[part]] + cells + [versus]) + " |")
    return "\n".join(lines)


def check_table(meta, rows):
    """Markdown: per layer, each implementation's largest |difference| from the reference over out
    and gradients (None when no implementation was compared)."""
    names = [n for n in columns(meta, rows) if any(r["impl"] == n and r.get("max_abs_err") is not None
                                                   for r in rows)]
    if not names:
        return None
    lines = ["| model | layer | checked against | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 3)]
    for layer_id, by_impl in by_layer(rows).items():
        model, kind, _ = layer_label(meta["layers"][layer_id])
        against = next((r["checked_against"] for r in by_impl.values() if r.get("checked_against")), None)
        if against is None:
            continue
        cells = []
        for n in names:
            r = by_impl.get(n, {})
            err = r.get("max_abs_err")
            cells.append("—" if err is None else f"{err:.2g}" + (MISMATCH_MARK if r.get("mismatch") else ""))
        lines.append(f"| {model} | {kind.split(';')[0]} | {against} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def notes(meta, rows):
    """The table's footnotes, one line each."""
    out = [f"{impl} not in this run: {reason}." for impl, reason in meta.get("skipped", {}).items()]
    for r in rows:
        if r.get("error"):
            out.append(f"{ERROR_MARK} {r['impl']} on {r['layer']}: {r['error']}")
        out += [f"{ERROR_MARK} {r['impl']} on {r['layer']}, {PART_NAMES[part]}: {r[f'{part}_error']}"
                for part in PARTS if r.get(f"{part}_error")]
    mismatches = [r for r in rows if r.get("mismatch")]
    if mismatches:
        out.append(f"{MISMATCH_MARK} output or gradients differ from the reference's by more than "
                   f"{compare.MISMATCH_TOL} (largest |difference| over the largest |reference|): "
                   + ", ".join(f"{r['impl']} on {r['layer']} ({r['max_err']:.2g})" for r in mismatches))
    for layer_id, info in meta["layers"].items():
        if info.get("jagflash_path"):
            out.append(f"jagflash on {layer_id}: {info['jagflash_path']} (no Hopper kernel for this layer).")
        if info.get("repeat_ms") is not None:
            out.append(f"{layer_id}: the peers take the {info['pooled']}-row query set repeated per sequence "
                       f"({info['sequences']} copies, made once, outside their timed calls); the repeat costs "
                       f"{info['repeat_ms']:.3f} ms and the sum of dq over the copies {info['dq_sum_ms']:.3f} ms, "
                       "not in their figures.")
    noted = {}  # (impl, note): the layers it applies to
    for r in rows:
        if r.get("note"):
            noted.setdefault((r["impl"], r["note"]), []).append(r["layer"])
    out += [f"{impl} on {', '.join(layer_ids)}: {note}." for (impl, note), layer_ids in noted.items()]
    kernel_note = report.kernel_timed_note(meta, rows)
    if kernel_note:
        out.append(kernel_note)
    return out


def method(meta):
    """The section's sentence on what was measured and how."""
    scaled_down = f"; lengths and sequences / {meta['scale']}" if meta.get("scale", 1) > 1 else ""
    return (f"One layer's attention, bf16, TFLOP/s of useful work (visible pairs under the mask and window; "
            f"forward 2·H·pairs·(D + Dv), backward 2·H·pairs·(3D + 2Dv), fwd + bwd both) and ms a call, medians "
            f"of samples taken in turns ({meta['timer']}; {meta['fwd_calls']} forward calls or "
            f"{meta['bwd_calls']} backward calls or steps a sample); fwd + bwd is a training step through autograd "
            f"(FA2 through aten). docpack: log-normal document lengths around 900 in [64, 8192] (sweep.py's), "
            f"{meta['tokens']} tokens{scaled_down}. A window of W: the query and the W − 1 keys before it. Sinks: "
            f"one fp32 logit per query head in the softmax's denominator (FlexAttention: its out · sigmoid(lse − "
            f"sink)).")


def markdown(meta, rows, png_name):
    """(heading, body) of the section: models.md is both, bench/RESULTS.md keeps its own heading."""
    runs = meta.get("runs") or [meta]
    heading = f"## bench/models.py, {meta['date']}, {meta['commit']}"
    body = [f"- **Latest run:** {', '.join(sorted({r['date'] for r in runs}))}, commit "
            f"{', '.join(sorted({r['commit'] for r in runs}))}, **{meta['gpu']}** (torch {meta['torch']}, CUDA "
            f"{meta['cuda']}, cuDNN {meta['cudnn']}), jagflash library {meta['jagflash']}.",
            "- **Command:** " + "; ".join(f"`{r['command']}`" for r in runs) + ".",
            f"- {method(meta)}", "", table(meta, rows)]
    checks = check_table(meta, rows)
    if checks:
        body += ["", "Largest |difference| from the reference over out and the gradients (dq, dk, dv, and the "
                 "sinks' where the layer has them), the last timed call's:", "", checks]
    lines = notes(meta, rows)
    if lines:
        body += [""] + [f"- {n}" for n in lines]
    if png_name:
        body += ["", f"![jagflash / best peer per layer]({png_name})"]
    return heading, "\n".join(body) + "\n"


def chart(meta, rows, path):
    """Bars of jagflash / the best peer per layer, one per part, with the peer's name; a line at 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = by_layer(rows)
    labels = []
    for layer_id in groups:
        model, layer, _ = layer_label(meta["layers"][layer_id])
        labels.append("\n".join([model] + [textwrap.fill(part, 20) for part in layer.split("; ")]))
    fig, ax = plt.subplots(figsize=(max(8.0, 1.5 * len(groups)), 5.5))
    width = 0.8 / len(PARTS)
    for i, part in enumerate(PARTS):
        xs = [x + (i - (len(PARTS) - 1) / 2) * width for x in range(len(groups))]
        found = [best_peer(by_impl, part) for by_impl in groups.values()]
        ax.bar(xs, [r or 0.0 for r, _ in found], width, label=PART_NAMES[part])
        for x, (ratio, peer) in zip(xs, found):
            text = "no ratio" if ratio is None else f"{ratio:.2f} vs {peer}"  # a side did not run: the table says why
            ax.annotate(text, (x, ratio or 0.0), xytext=(0, 2), textcoords="offset points", ha="center",
                        va="bottom", fontsize=6, rotation=90)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("jagflash / best peer (TFLOP/s)")
    ax.margins(y=0.35)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    ax.set_title(f"bench/models.py {meta['date']} {meta['commit']} ({meta['gpu']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def load(dirs):
    """The rows of several runs' models.json as one run (a layer measured twice: the later run's),
    meta from the first with every run's date, commit and command."""
    meta, rows, runs = None, {}, []
    for d in dirs:
        saved = json.loads((Path(d) / "models.json").read_text())
        if meta is None:
            meta = saved["meta"]
        else:
            meta["layers"].update(saved["meta"]["layers"])
            meta["skipped"].update(saved["meta"].get("skipped", {}))
            meta["columns"] += [n for n in saved["meta"]["columns"] if n not in meta["columns"]]
        runs.append({k: saved["meta"][k] for k in ("date", "commit", "command")})
        layer_ids = {r["layer"] for r in saved["rows"]}
        rows = {k: r for k, r in rows.items() if k[0] not in layer_ids}
        rows.update({(r["layer"], r["impl"]): r for r in saved["rows"]})
    meta["runs"] = runs
    return meta, list(rows.values())


def update_results(results_md, heading, body):
    """bench/RESULTS.md with its models section's text (after its heading, up to the next section)
    replaced by body."""
    lines = Path(results_md).read_text().splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.startswith("## ") and RESULTS_SECTION in line)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    Path(results_md).write_text("".join(lines[: start + 1] + ["\n", body, "\n"] + lines[end:]))


def main(argv=None):
    args = parse_args(argv)
    out_dir = Path(args.out)
    if args.from_dirs:
        meta, rows = load(args.from_dirs)
        if args.commit:
            meta["commit"] = args.commit
    else:
        t0 = time.time()
        meta, rows = run(args, out_dir)
        meta["seconds"] = round(time.time() - t0, 1)
        save(out_dir, meta, rows)
    out_dir.mkdir(parents=True, exist_ok=True)
    png_name = f"models-{meta['date']}-{meta['commit'].replace('+', '-')}.png"
    try:
        chart(meta, rows, out_dir / png_name)
    except ImportError as e:  # the table and the numbers matter more than the picture
        print(f"models.py: no chart ({e}); render it later with --from {out_dir}")
        png_name = None
    heading, body = markdown(meta, rows, png_name)
    (out_dir / "models.md").write_text(heading + "\n\n" + body)
    if args.update_results:
        update_results(HERE / "RESULTS.md", heading, body)
        history, png = report.append_results(heading + "\n\n" + body, out_dir / png_name if png_name else None, HERE)
        print(f"models.py: bench/RESULTS.md's section replaced; appended to {history}; chart {png}")
    print("models.py: one layer of each model, TFLOP/s (ms a call); jagflash / the best peer last")
    print(table(meta, rows))
    for line in notes(meta, rows):
        print(f"- {line}")
    failed = [(r, failure(r)) for r in rows if failure(r)]
    for r, why in failed:
        print(f"FAILED: {r['impl']} on {r['layer']}: {why}")
    return 1 if failed else 0


def failure(row):
    """Why a row fails the run, or None: a peer that cannot run is recorded and tolerated; jagflash
    failing, or any implementation differing from the reference, is not."""
    if row.get("mismatch"):
        return f"differs from {row['checked_against']}'s by {row['max_err']:.3g} (normalised)"
    if row["impl"] == "jagflash":
        return row.get("error") or next((row[f"{p}_error"] for p in PARTS if row.get(f"{p}_error")), None)
    return None


if __name__ == "__main__":
    sys.exit(main())
