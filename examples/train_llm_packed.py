"""Packed causal-LM training with Hugging Face transformers and jagflash, beside the padded way.

A small Llama, built from a LlamaConfig and randomly initialised (nothing is downloaded), learns
synthetic documents of varied lengths. Three ways to feed the same batches to the same weights:

  jagged_attention  the documents packed back to back into one row, position_ids restarting at 0
                    at each document and cu_seq_lens marking the boundaries (what transformers'
                    DataCollatorWithFlattening gives); attention runs per document in jagflash
                    (jagflash.integrations.transformers.register()). No padding token is computed.
  sdpa              the usual padded batch: one row per document, padded to the longest, with an
                    attention mask; transformers' own SDPA attention.
  torch_varlen      CUDA only: the packed row again, attention by PyTorch's FlashAttention-2
                    varlen kernel (torch.nn.attention.varlen.varlen_attn), registered with
                    transformers the same way jagflash is. PyTorch has no CPU kernel for it.

Printed at the end: tokens/s (real tokens only, so the padded run is not credited for its
padding) and the final loss of each. The data: each document counts through the vocabulary with
its own start and stride (t, t+s, t+2s, ... mod vocab), so the next token is predictable from the
two before it within the document, never across a document boundary; a model that attended
across documents would be confused at each boundary, one that does not learns it in a few steps.

    python examples/train_llm_packed.py                       # CUDA when available
    python examples/train_llm_packed.py --device cpu --steps 20
    python examples/train_llm_packed.py --docs 64 --max-len 8192 --layers 8

On CUDA the model is bf16 (weights included: all three attention paths then get bf16 q/k/v, the
dtype the FlashAttention kernels take). On the CPU everything is float32 and jagflash runs its
float64 C++ reference, so the default sizes there are tiny. With jagflash from a source checkout:
PYTHONPATH=python JAGFLASH_LIBRARY=build/libjagflash.so.
"""
import argparse
import copy
import math
import os
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import example_common as common  # noqa: E402

# Per-device defaults for the options left at None. CUDA: a model big enough for attention to
# matter at these lengths; the vocabulary stays small so the padded run's logits (rows x longest
# document x vocab) fit beside it. CPU: a model the float64 reference trains in a second.
GPU_DEFAULTS = dict(steps=30, docs=32, min_len=64, max_len=4096, layers=4, hidden=1024, heads=8,
                    kv_heads=4, vocab=8192, lr=1e-3)
CPU_DEFAULTS = dict(steps=12, docs=8, min_len=4, max_len=48, layers=2, hidden=64, heads=4,
                    kv_heads=2, vocab=64, lr=1e-2)
VARLEN_NAME = "torch_varlen"  # no "flash" in it: transformers 5.x would look for a hub kernel
IMPLEMENTATIONS = ("jagged_attention", "sdpa", VARLEN_NAME)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_arguments(parser, IMPLEMENTATIONS)
    parser.add_argument("--docs", type=int, default=None, help="documents per batch")
    parser.add_argument("--min-len", type=int, default=None, help="shortest document (tokens)")
    parser.add_argument("--max-len", type=int, default=None, help="longest document (tokens)")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=None, help="model width")
    parser.add_argument("--heads", type=int, default=None, help="query heads (head dim = hidden / heads)")
    parser.add_argument("--kv-heads", type=int, default=None, help="key/value heads (GQA)")
    parser.add_argument("--vocab", type=int, default=None)
    return common.finish_args(parser, argv, GPU_DEFAULTS, CPU_DEFAULTS)


# ---- Data: the same documents for every implementation, in two layouts.

def make_documents(generator, args):
    """One batch: `docs` documents, lengths log-uniform in [min_len, max_len] (many short ones,
    a few long ones, as in real pretraining mixes), each an arithmetic progression mod vocab."""
    log_min, log_max = math.log(args.min_len), math.log(args.max_len)
    docs = []
    for _ in range(args.docs):
        u = torch.rand((), generator=generator).item()
        length = int(round(math.exp(log_min + u * (log_max - log_min))))
        start = torch.randint(args.vocab, (), generator=generator)
        stride = torch.randint(1, 4, (), generator=generator)
        docs.append((start + stride * torch.arange(length)) % args.vocab)
    return docs


def next_token_labels(doc):
    """doc's next tokens, -100 (ignored) at its last token: no target crosses a boundary."""
    return torch.cat([doc[1:], doc.new_full((1,), -100)])


@dataclass
class Batch:
    inputs: dict  # the model's keyword arguments
    labels: torch.Tensor  # same shape as input_ids, -100 where nothing is predicted
    tokens: int  # real tokens (padding excluded)


def packed_batch(docs, device):
    """[1, total] row, position_ids restarting per document, cu_seq_lens (int32 offsets [n+1])
    and max_length, as DataCollatorWithFlattening gives them: jagflash reads the offsets as they
    are, without a host sync; position_ids still drive the rotary embedding."""
    lengths = torch.tensor([len(d) for d in docs])
    cu_seq_lens = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32).to(device)
    max_len = int(lengths.max())
    inputs = dict(
        input_ids=torch.cat(docs)[None].to(device),
        position_ids=torch.cat([torch.arange(len(d)) for d in docs])[None].to(device),
        cu_seq_lens_q=cu_seq_lens, cu_seq_lens_k=cu_seq_lens, max_length_q=max_len, max_length_k=max_len)
    labels = torch.cat([next_token_labels(d) for d in docs])[None].to(device)
    return Batch(inputs, labels, int(lengths.sum()))


def padded_batch(docs, device):
    """[docs, longest] rows, right-padded, with a padding attention mask."""
    longest = max(len(d) for d in docs)
    ids = torch.zeros(len(docs), longest, dtype=torch.long)
    mask = torch.zeros(len(docs), longest, dtype=torch.long)
    labels = torch.full((len(docs), longest), -100, dtype=torch.long)
    for row, d in enumerate(docs):
        ids[row, :len(d)], mask[row, :len(d)], labels[row, :len(d)] = d, 1, next_token_labels(d)
    inputs = dict(input_ids=ids.to(device), attention_mask=mask.to(device))
    return Batch(inputs, labels.to(device), int(mask.sum()))


# ---- The FlashAttention-2 peer: PyTorch's varlen kernel as a transformers attention function.

def varlen_unavailable(device):
    """Why the torch_varlen peer cannot run here, or None when it can."""
    if device.type != "cuda":
        return ("PyTorch has no CPU kernel for varlen_attn's op (aten::_flash_attention_forward); "
                "it runs on CUDA only")
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError as error:
        return f"torch.nn.attention.varlen.varlen_attn is not in this torch ({error})"
    return None


def torch_varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                           cu_seq_lens_q=None, cu_seq_lens_k=None, max_length_q=None, max_length_k=None,
                           **kwargs):
    """transformers' attention interface over varlen_attn: query [1, H, total, D], key and value
    [1, H_kv, total, D] (GQA: FlashAttention-2 takes fewer K/V heads as they are); returns
    ([1, total, H, D], None). Only the packed case this example feeds it."""
    from torch.nn.attention.varlen import varlen_attn

    if cu_seq_lens_q is None or attention_mask is not None or dropout:
        raise ValueError("torch_varlen serves packed rows with cu_seq_lens only (no mask, no dropout)")
    q, k, v = (t.transpose(1, 2).flatten(0, 1) for t in (query, key, value))  # [total, heads, D]
    out = varlen_attn(q, k, v, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, scale=scaling,
                      window_size=(-1, 0))  # causal
    return out.view(query.shape[0], -1, *out.shape[1:]), None


def register_varlen():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(VARLEN_NAME, torch_varlen_attention)
    # The padding mask FlashAttention takes (None for packed rows), as jagflash registers it.
    AttentionMaskInterface.register(VARLEN_NAME, flash_attention_mask)


# ---- Training.

def build_config(args):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=int(args.hidden * 8 / 3) // 8 * 8,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(args.max_len, 64), attention_dropout=0.0, pad_token_id=0)


def train(name, config, initial_state, batches, args):
    """AdamW over the batches from the shared initial weights. Returns (losses, tokens/s)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=name)
    model.load_state_dict(initial_state)
    dtype = torch.bfloat16 if args.device.type == "cuda" else torch.float32
    model.to(device=args.device, dtype=dtype).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    timer = common.StepTimer(args.device, args.warmup)
    bar = common.progress_bar(len(batches), f"{name:>16}", args.progress)
    losses = []
    for step, batch in enumerate(batches):
        timer.before_step(step)
        logits = model(**batch.inputs).logits
        # Mean next-token cross entropy over the real tokens: the same targets in either layout,
        # so the losses are comparable (and equal at step 0, from the same weights).
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch.labels.flatten(), ignore_index=-100)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
        timer.after_step(step, batch.tokens)
        # The bar shows the previous step's loss: it is ready by now, so reading it does not
        # wait for the step just queued on the GPU.
        bar.step(f"loss {losses[-2].item():.3f}" if len(losses) > 1 else "")
    rate = timer.tokens_per_s()
    losses = [float(x) for x in losses]
    bar.close(f"loss {losses[-1]:.3f}")
    return losses, rate


def main(argv=None):
    """Runs the comparison; returns {"device", "reference_path", "jagflash_paths" (CUDA: the path
    serving each direction, e.g. {"forward": "hopper", "backward": "hopper"}; None on the CPU),
    "results": {name: {"losses", "tokens_per_s", "final_loss"}}, "skipped": {name: why}}."""
    args = parse_args(argv)
    try:
        import transformers
    except ImportError:
        sys.exit("train_llm_packed.py needs Hugging Face transformers (pip install transformers)")
    import jagflash  # registers the ops
    from jagflash.integrations import transformers as jf_transformers

    jf_transformers.register()
    register_varlen()
    if args.device.type == "cpu":
        print(common.CPU_NOTE)
    config = build_config(args)
    torch.manual_seed(args.seed)
    initial_state = copy.deepcopy(transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config)).state_dict())
    generator = torch.Generator().manual_seed(args.seed + 1)
    documents = [make_documents(generator, args) for _ in range(args.steps)]
    tokens = sum(len(d) for docs in documents for d in docs) / args.steps
    padded = sum(len(docs) * max(len(d) for d in docs) for docs in documents) / args.steps
    print(f"Llama {args.layers} layers, width {args.hidden}, {args.heads} heads ({args.kv_heads} KV), "
          f"vocab {args.vocab}, on {args.device}; {args.steps} steps of {args.docs} documents "
          f"({args.min_len}-{args.max_len} tokens): {tokens:.0f} tokens a step, {padded:.0f} once padded "
          f"({padded / tokens:.1f}x)")
    paths = None
    if args.device.type == "cuda":
        # Which path serves jagflash's bf16 attention at this head dim: "hopper" where this build's
        # Hopper kernels serve it (the defaults' 1024 / 8 = 128 is), "oracle" (the slow path)
        # otherwise. Said, not assumed.
        head_dim = args.hidden // args.heads
        q = torch.empty(1, args.heads, head_dim, device=args.device, dtype=torch.bfloat16)
        kv = torch.empty(1, args.kv_heads, head_dim, device=args.device, dtype=torch.bfloat16)
        offsets = torch.tensor([0, 1], dtype=torch.int32, device=args.device)
        paths = {d: str(jagflash.backend(q, kv, kv, offsets, backward=d == "backward")) for d in ("forward", "backward")}
        print(f"jagflash at head dim {head_dim}, bf16: forward on {paths['forward']}, backward on {paths['backward']}")

    results, skipped = {}, {}
    with common.cpu_threads(args.device):
        for name in args.implementations:
            why = varlen_unavailable(args.device) if name == VARLEN_NAME else None
            if why is not None:
                skipped[name] = why
                continue
            make = padded_batch if name == "sdpa" else packed_batch
            batches = [make(docs, args.device) for docs in documents]  # built before the clock starts
            losses, rate = train(name, config, initial_state, batches, args)
            results[name] = dict(losses=losses, tokens_per_s=rate, final_loss=losses[-1])
            del batches
            if args.device.type == "cuda":
                torch.cuda.empty_cache()
    print()
    common.print_table([(n, r["tokens_per_s"], r["final_loss"]) for n, r in results.items()], skipped)
    return dict(device=str(args.device), reference_path=args.device.type == "cpu", jagflash_paths=paths,
                results=results, skipped=skipped)


if __name__ == "__main__":
    main()
