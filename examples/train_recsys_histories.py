"""Sequential recommendation over jagged user histories with jagflash, beside the padded way.

jagflash's main use case: user histories of very different lengths (here 10 to 10,000 events,
log-normal, so most are short and a few are very long). A batch packs them back to back: item ids
[total_events] and offsets [users+1]; nothing is padded anywhere in the model:

  item + category embeddings [total_events, dim]
  -> one pre-norm transformer block: self-attention within each history (jagflash.jagged_attention)
  -> pooling, two heads over each user's encoded history:
       PMA (Pooling by Multihead Attention): S learned seed queries shared by all users attend
         over each history (jagflash.pooled_attention): S interest vectors per user;
       target-aware attention: the candidate item's own query attends over its user's history
         (jagflash.jagged_attention with one query per user), the part of the history that
         bears on this candidate;
  -> MLP on [interests, target-aware vector, candidate, their product] -> click logit.

The baseline is the same model with the same weights and batches, written as a recsys engineer
would today: histories padded to the batch's longest into [users, longest], and every attention
by F.scaled_dot_product_attention with a key padding mask. Both print tokens/s (history events per
second, padding not counted) and the final loss.

The synthetic task: items belong to categories; each user mostly clicks one favourite category,
the history says which; the candidate is either from that category (clicked) or from another
(not clicked), half and half. Binary cross entropy starts at log 2 and falls within a few steps.

    python examples/train_recsys_histories.py                       # CUDA when available
    python examples/train_recsys_histories.py --device cpu --steps 40
    python examples/train_recsys_histories.py --users 256 --max-len 10000

On CUDA the parameters are fp32 and the forward runs under bf16 autocast (bf16 q/k/v for both
implementations). On the CPU jagflash runs its float64 C++ reference, so the sizes there are small
(histories of 4 to 256 events). With jagflash from a source checkout: PYTHONPATH=python
JAGFLASH_LIBRARY=build/libjagflash.so.
"""
import argparse
import contextlib
import math
import os
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import jagflash

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import example_common as common  # noqa: E402

# Per-device defaults for the options left at None. head dim = dim / heads: 64 on CUDA (a Hopper
# kernel's), 16 on the CPU (the reference takes any multiple of 8).
GPU_DEFAULTS = dict(steps=40, users=128, min_len=10, max_len=10000, items=100_000, categories=20,
                    dim=256, heads=4, seeds=4, lr=1e-3)
CPU_DEFAULTS = dict(steps=30, users=64, min_len=4, max_len=256, items=1000, categories=8,
                    dim=32, heads=2, seeds=2, lr=1e-2)
IMPLEMENTATIONS = ("jagflash", "padded_sdpa")
FAVOURITE_SHARE = 0.7  # share of a user's events from the favourite category; the rest at random


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_arguments(parser, IMPLEMENTATIONS)
    parser.add_argument("--users", type=int, default=None, help="histories per batch")
    parser.add_argument("--min-len", type=int, default=None, help="shortest history (events)")
    parser.add_argument("--max-len", type=int, default=None, help="longest history (events)")
    parser.add_argument("--items", type=int, default=None, help="item vocabulary")
    parser.add_argument("--categories", type=int, default=None, help="item categories (item id mod this)")
    parser.add_argument("--dim", type=int, default=None, help="model width")
    parser.add_argument("--heads", type=int, default=None, help="attention heads (head dim = dim / heads)")
    parser.add_argument("--seeds", type=int, default=None, help="PMA seed queries (interests per user)")
    return common.finish_args(parser, argv, GPU_DEFAULTS, CPU_DEFAULTS)


# ---- Data.

@dataclass
class Histories:
    """One batch as generated (on the CPU): the histories packed, and one candidate per user."""
    items: torch.Tensor  # int64 [total_events]
    lengths: torch.Tensor  # int64 [users]
    candidates: torch.Tensor  # int64 [users]
    clicks: torch.Tensor  # float32 [users], 1 when the candidate is in the user's favourite category


def history_lengths(generator, args):
    """Log-normal lengths clipped to [min_len, max_len]: the median a third of the way up the log
    range and sigma a fifth of it, so most histories are short and a few reach max_len."""
    log_min, log_max = math.log(args.min_len), math.log(args.max_len)
    mu, sigma = log_min + 0.35 * (log_max - log_min), (log_max - log_min) / 5
    normal = torch.randn(args.users, generator=generator, dtype=torch.float64)
    return (mu + sigma * normal).exp().round().clamp(args.min_len, args.max_len).long()


def item_in(categories, generator, args):
    """A random item of each given category (items are spread over categories by id mod C)."""
    per_category = args.items // args.categories
    return categories + args.categories * torch.randint(per_category, categories.shape, generator=generator)


def make_histories(generator, args):
    lengths = history_lengths(generator, args)
    favourite = torch.randint(args.categories, (args.users,), generator=generator)
    per_event = favourite.repeat_interleave(lengths)
    total = int(lengths.sum())
    from_favourite = torch.rand(total, generator=generator) < FAVOURITE_SHARE
    items = torch.where(from_favourite, item_in(per_event, generator, args),
                        torch.randint(args.categories * (args.items // args.categories), (total,), generator=generator))
    clicks = torch.rand(args.users, generator=generator) < 0.5
    # A negative candidate is from any category but the favourite one.
    other = (favourite + torch.randint(1, args.categories, (args.users,), generator=generator)) % args.categories
    candidates = item_in(torch.where(clicks, favourite, other), generator, args)
    return Histories(items, lengths, candidates, clicks.float())


@dataclass
class Batch:
    events: torch.Tensor  # jagged: [total_events]; padded: [users, longest]
    candidates: torch.Tensor
    clicks: torch.Tensor
    attention: object  # JaggedAttention or PaddedAttention for this batch
    tokens: int  # history events (padding excluded)


class JaggedAttention:
    """The three attentions on packed histories: [total_events, H, Dh] with offsets [users+1]."""

    def __init__(self, lengths, device):
        self.offsets = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32).to(device)
        self.users = len(lengths)
        # One query per user for the target-aware head: query offsets 0, 1, ..., users.
        self.one_per_user = torch.arange(self.users + 1, dtype=torch.int32, device=device)
        self.max_len = int(lengths.max())  # known to the data loader: a kernel-choice hint, no sync

    def self_attention(self, q, k, v):
        return jagflash.jagged_attention(q, k, v, self.offsets, max_seqlen_q=self.max_len)

    def pool(self, seeds, k, v):
        """seeds [S, H, Dh] shared by every user -> [users, S, H, Dh]."""
        out = jagflash.pooled_attention(seeds.to(k.dtype), k, v, self.offsets)
        return out.unflatten(0, (self.users, seeds.shape[0]))

    def target(self, q, k, v):
        """q [users, H, Dh], user b's row against b's history -> [users, H, Dh]."""
        return jagflash.jagged_attention(q, k, v, self.one_per_user, self.offsets, max_seqlen_q=1,
                                         max_seqlen_kv=self.max_len)


class PaddedAttention:
    """The same three on padded histories: [users, longest, H, Dh] with a key padding mask."""

    def __init__(self, lengths, device):
        longest = int(lengths.max())
        real = torch.arange(longest) < lengths[:, None]  # [users, longest], True on real events
        self.mask = real[:, None, None, :].to(device)  # broadcast over heads and queries

    def _sdpa(self, q, k, v):
        """q [users, Lq, H, Dh] against k, v [users, longest, H, Dh], padded keys masked out."""
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=self.mask)
        return out.transpose(1, 2)

    def self_attention(self, q, k, v):
        # Padded query rows get values too (they attend to the real keys); nothing reads them:
        # they are masked out as keys below.
        return self._sdpa(q, k, v)

    def pool(self, seeds, k, v):
        return self._sdpa(seeds.to(k.dtype).expand(k.shape[0], -1, -1, -1), k, v)

    def target(self, q, k, v):
        return self._sdpa(q.unsqueeze(1), k, v).squeeze(1)


def to_batch(histories, implementation, device):
    """The batch in the implementation's layout, on the device."""
    if implementation == "jagflash":
        events = histories.items.to(device)
        attention = JaggedAttention(histories.lengths, device)
    else:
        events = torch.zeros(len(histories.lengths), int(histories.lengths.max()), dtype=torch.long)
        # Row b takes its history's events in columns [0, length_b); padding stays item 0, masked.
        real = torch.arange(events.shape[1]) < histories.lengths[:, None]
        events[real] = histories.items
        events = events.to(device)
        attention = PaddedAttention(histories.lengths, device)
    return Batch(events, histories.candidates.to(device), histories.clicks.to(device), attention,
                 int(histories.lengths.sum()))


# ---- The model: every layer works per event (any leading shape) except the attentions, which the
# batch's JaggedAttention or PaddedAttention supplies; so both layouts run the same weights.

class ClickModel(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.categories, self.heads, dim = args.categories, args.heads, args.dim
        self.item = nn.Embedding(args.items, dim)
        self.category = nn.Embedding(args.categories, dim)  # a side feature, as real item towers have
        self.attn_norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.attn_out = nn.Linear(dim, dim)
        self.mlp_norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.pool_norm = nn.LayerNorm(dim)
        self.pool_kv = nn.Linear(dim, 2 * dim)  # keys and values the two pooling heads read
        self.seeds = nn.Parameter(torch.randn(args.seeds, args.heads, dim // args.heads))
        self.target_q = nn.Linear(dim, dim)
        self.head = nn.Sequential(nn.Linear((args.seeds + 3) * dim, dim), nn.GELU(), nn.Linear(dim, 1))

    def embed(self, items):
        return self.item(items) + self.category(items % self.categories)

    def split_heads(self, x, parts):
        """[..., parts * dim] -> `parts` tensors [..., heads, head dim]."""
        return x.unflatten(-1, (parts, self.heads, -1)).unbind(-3)

    def forward(self, batch):
        attention = batch.attention
        x = self.embed(batch.events)
        # Self-attention: every event sees the user's whole history (all of it is known when
        # the candidate is scored), never another user's.
        q, k, v = self.split_heads(self.qkv(self.attn_norm(x)), 3)
        x = x + self.attn_out(attention.self_attention(q, k, v).flatten(-2))
        x = x + self.mlp(self.mlp_norm(x))
        k, v = self.split_heads(self.pool_kv(self.pool_norm(x)), 2)
        interests = attention.pool(self.seeds, k, v).flatten(1)  # [users, S * dim]
        candidate = self.embed(batch.candidates)  # [users, dim]
        (target_q,) = self.split_heads(self.target_q(candidate), 1)
        focused = attention.target(target_q, k, v).flatten(1)  # [users, dim]
        # The product term gives the MLP the candidate-history match directly (as DIN-style
        # models do), rather than leaving it to learn a multiplication.
        features = torch.cat([interests, focused, candidate, focused * candidate], dim=-1)
        return self.head(features).squeeze(-1)


def autocast(device):
    """bf16 autocast on CUDA (fp32 master weights); fp32 on the CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def train(implementation, initial_state, histories, args):
    """Adam over the batches from the shared initial weights. Returns (losses, tokens/s)."""
    model = ClickModel(args)
    model.load_state_dict(initial_state)
    model.to(args.device).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    batches = [to_batch(h, implementation, args.device) for h in histories]  # before the clock starts
    timer = common.StepTimer(args.device, args.warmup)
    bar = common.progress_bar(len(batches), f"{implementation:>11}", args.progress)
    losses = []
    for step, batch in enumerate(batches):
        timer.before_step(step)
        with autocast(args.device):
            logits = model(batch)
        loss = F.binary_cross_entropy_with_logits(logits.float(), batch.clicks)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
        timer.after_step(step, batch.tokens)
        # The previous step's loss: ready by now, so reading it does not wait for this step.
        bar.step(f"loss {losses[-2].item():.3f}" if len(losses) > 1 else "")
    rate = timer.tokens_per_s()
    if args.device.type == "cuda":
        jagflash.read_device_error()  # raises if a device-side offsets check failed meanwhile
    losses = [float(x) for x in losses]
    bar.close(f"loss {losses[-1]:.3f}")
    return losses, rate


def main(argv=None):
    """Runs the comparison; returns {"device", "reference_path", "results": {name: {"losses",
    "tokens_per_s", "final_loss"}}, "skipped": {}, "events_per_step", "padded_per_step"}."""
    args = parse_args(argv)
    if args.device.type == "cpu":
        print(common.CPU_NOTE)
    torch.manual_seed(args.seed)
    initial_state = {k: v.clone() for k, v in ClickModel(args).state_dict().items()}
    generator = torch.Generator().manual_seed(args.seed + 1)
    histories = [make_histories(generator, args) for _ in range(args.steps)]
    events = sum(int(h.lengths.sum()) for h in histories) / args.steps
    padded = sum(len(h.lengths) * int(h.lengths.max()) for h in histories) / args.steps
    longest = max(int(h.lengths.max()) for h in histories)
    print(f"{args.users} histories a step ({args.min_len}-{args.max_len} events, log-normal): {events:.0f} events "
          f"a step, {padded:.0f} once padded to each batch's longest ({padded / events:.1f}x; longest {longest}); "
          f"{args.items} items, width {args.dim}, {args.heads} heads, {args.seeds} PMA seeds, on {args.device}")

    results = {}
    with common.cpu_threads(args.device):
        for implementation in args.implementations:
            losses, rate = train(implementation, initial_state, histories, args)
            results[implementation] = dict(losses=losses, tokens_per_s=rate, final_loss=losses[-1])
            if args.device.type == "cuda":
                torch.cuda.empty_cache()
    print()
    common.print_table([(n, r["tokens_per_s"], r["final_loss"]) for n, r in results.items()], {})
    return dict(device=str(args.device), reference_path=args.device.type == "cpu", results=results, skipped={},
                events_per_step=events, padded_per_step=padded)


if __name__ == "__main__":
    main()
