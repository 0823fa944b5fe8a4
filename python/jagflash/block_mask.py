"""jagflash.BlockMask: block-sparse attention over a jagged batch (jf_block_mask,
include/jagflash/jagflash.h), FlexAttention's BlockMask idea at one fixed granularity.

Each sequence b of a batch with Lq_b queries and Lk_b keys has a map of nq_b x nk_b bytes,
nq_b = ceil(Lq_b / 128), nk_b = ceil(Lk_b / 128), row-major (query block major), nonzero = the
query block sees the key block. Blocks are counted from the sequence's first query and first key
(not from the packed tensor's row 0). Query i of sequence b sees key j when the mask of the call
(causal, window) lets it AND byte (i // 128, j // 128) of b's map is nonzero. A row that sees no
key gets out = 0, lse = -inf and zero gradients, as with a window.

    mask = jagflash.BlockMask.from_fn(lambda b, qb, kb: (qb // 4) == (kb // 4), q_offsets)
    out = jagflash.jagged_attention(q, k, v, q_offsets, block_mask=mask, causal=True)

The maps of every sequence are packed back to back into one uint8 vector `blocks`, sequence b's at
offsets[b] (int32 [B+1], like the token offsets): both live where q lives. The constructors read
the token offsets on the host (a sync on CUDA, once, when the mask is built; a mask built once serves
every layer of a step); jagged_attention reads nothing on the host and checks the offsets' values
(offsets[b+1] - offsets[b] == nq_b * nk_b) in the C library, as it checks q_offsets.
"""
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import _capi
from ._errors import invalid_argument

BLOCK = _capi.BLOCK_MASK_BLOCK


def blocks_of(length: int) -> int:
    """Blocks of BLOCK tokens covering `length` tokens."""
    return -(-length // BLOCK)


def _describe(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} of shape {tuple(t.shape)} on {t.device}"
    return type(t).__name__


def _host_lengths(name: str, offsets: object) -> List[int]:
    """The lengths of int32/int64 [B+1] offsets, read on the host (one copy), checked as the C
    library checks token offsets, with the argument named."""
    if not isinstance(offsets, torch.Tensor) or offsets.is_nested or offsets.layout is not torch.strided or \
            offsets.is_meta or offsets.dtype not in (torch.int32, torch.int64) or offsets.dim() != 1 or \
            offsets.numel() < 1:
        raise invalid_argument(name, "an int32 or int64 vector of B+1 >= 1 offsets", _describe(offsets))
    values = offsets.tolist()
    if values[0] != 0:
        raise invalid_argument(f"{name}[0]", "0", values[0])
    lengths = []
    for b in range(len(values) - 1):
        if values[b + 1] < values[b]:
            raise invalid_argument(f"{name}[{b + 1}]", f"a value >= {name}[{b}] = {values[b]} (non-decreasing)",
                                   values[b + 1])
        lengths.append(values[b + 1] - values[b])
    return lengths


def _sides(q_offsets: object, kv_offsets: object) -> Tuple[List[int], List[int], torch.device]:
    """(q lengths, kv lengths, device) of a batch; kv_offsets None means q's (self-attention)."""
    q_lengths = _host_lengths("q_offsets", q_offsets)
    kv_lengths = q_lengths if kv_offsets is None else _host_lengths("kv_offsets", kv_offsets)
    if len(kv_lengths) != len(q_lengths):
        raise invalid_argument("kv_offsets", f"B+1 = {len(q_lengths) + 1} entries (as many as q_offsets)",
                               len(kv_lengths) + 1)
    assert isinstance(q_offsets, torch.Tensor)
    return q_lengths, kv_lengths, q_offsets.device


def _csr(counts: Sequence[int], device: torch.device) -> Tensor:
    out = [0]
    for n in counts:
        out.append(out[-1] + n)
    if out[-1] >= 2**31:
        raise invalid_argument("block_mask", "at most 2^31 - 1 map entries in all (int32 offsets)", out[-1])
    return torch.tensor(out, dtype=torch.int32, device=device)


class BlockMask:
    """Which 128 x 128 (query block, key block) pairs of each sequence may attend: `blocks` uint8
    [offsets[B]] (nonzero = visible) and `offsets` int32 [B+1], on q's device (module docstring).

    BlockMask(blocks, offsets) takes the packed form as is (not copied): blocks a uint8 (or bool)
    vector, offsets an int32 vector, one device, offsets[B] == blocks.numel() (read on the host:
    a sync when they are on CUDA). The constructors below build it from per-sequence maps, a
    function of the block indices, or a common pattern; they never write the caller's tensors."""

    BLOCK = BLOCK

    def __init__(self, blocks: Tensor, offsets: Tensor) -> None:
        if not isinstance(blocks, torch.Tensor) or blocks.layout is not torch.strided or blocks.is_nested or \
                blocks.dtype not in (torch.uint8, torch.bool) or blocks.dim() != 1:
            raise invalid_argument("blocks", "a uint8 (or bool) vector of map bytes", _describe(blocks))
        if not isinstance(offsets, torch.Tensor) or offsets.layout is not torch.strided or offsets.is_nested or \
                offsets.dtype != torch.int32 or offsets.dim() != 1 or offsets.numel() < 1:
            raise invalid_argument("offsets", "an int32 vector of B+1 >= 1 map offsets", _describe(offsets))
        if offsets.device != blocks.device:
            raise invalid_argument("offsets.device", f"{blocks.device} (blocks' device)", offsets.device)
        if not torch.compiler.is_compiling() and not blocks.is_meta:
            # At build time, and exactly: the C library refuses offsets[B] > blocks.numel() (its
            # jf_block_mask.bytes) at each call, but spare bytes past the map are a mistake too.
            last = int(offsets[-1])
            if last != blocks.numel():
                raise invalid_argument("blocks", f"offsets[B] = {last} map bytes", f"{blocks.numel()} bytes")
        self.blocks = blocks.view(torch.uint8) if blocks.dtype == torch.bool else blocks
        self.offsets = offsets

    def __repr__(self) -> str:
        return (f"BlockMask(B={self.offsets.numel() - 1}, entries={self.blocks.numel()}, "
                f"device={self.blocks.device})")

    @property
    def batch_size(self) -> int:
        return self.offsets.numel() - 1

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    def to(self, device: Any) -> "BlockMask":
        """The same mask on another device (copies; self unchanged)."""
        return BlockMask(self.blocks.to(device), self.offsets.to(device))

    def density(self) -> float:
        """The fraction of visible map entries (1.0 for an empty map). Reads the map on the host."""
        if self.blocks.numel() == 0:
            return 1.0
        return (self.blocks != 0).sum().item() / self.blocks.numel()

    def to_maps(self, q_offsets: Tensor, kv_offsets: Optional[Tensor] = None) -> List[Tensor]:
        """The per-sequence bool maps [nq_b, nk_b] (views of a fresh bool copy of blocks), for the
        batch of these offsets; checks that the map fits them."""
        q_lengths, kv_lengths, _ = _sides(q_offsets, kv_offsets)
        self._check_fits(q_lengths, kv_lengths)
        flat = self.blocks != 0
        starts = self.offsets.tolist()
        return [flat[starts[b]:starts[b + 1]].view(blocks_of(lq), blocks_of(lk))
                for b, (lq, lk) in enumerate(zip(q_lengths, kv_lengths))]

    def _check_fits(self, q_lengths: Sequence[int], kv_lengths: Sequence[int]) -> None:
        if self.batch_size != len(q_lengths):
            raise invalid_argument("block_mask", f"a map for B = {len(q_lengths)} sequences", self.batch_size)
        starts = self.offsets.tolist()
        for b, (lq, lk) in enumerate(zip(q_lengths, kv_lengths)):
            if starts[b + 1] - starts[b] != blocks_of(lq) * blocks_of(lk):
                raise invalid_argument(f"block_mask.offsets[{b + 1}] - block_mask.offsets[{b}]",
                                       f"{blocks_of(lq)} x {blocks_of(lk)} = {blocks_of(lq) * blocks_of(lk)} "
                                       f"(sequence {b}: {lq} queries, {lk} keys)", starts[b + 1] - starts[b])

    # ---- Constructors.

    @classmethod
    def from_maps(cls, maps: Sequence[Tensor], q_offsets: Optional[Tensor] = None,
                  kv_offsets: Optional[Tensor] = None) -> "BlockMask":
        """One 2-D map [nq_b, nk_b] per sequence (bool, or any integer dtype: nonzero = visible),
        for the batch of q_offsets and kv_offsets (None for q's): each map's shape is checked
        against ceil(L / 128) of its sequence, and the mask goes to the offsets' device. The
        offsets are required (None raises, naming q_offsets): without them a 1 x 2 map would be
        taken for a sequence that needs 2 x 1 (the same byte count) and read transposed."""
        if isinstance(maps, torch.Tensor) or not isinstance(maps, (list, tuple)):
            raise invalid_argument("maps", "a list of 2-D [nq_b, nk_b] bool tensors, one per sequence",
                                   type(maps).__name__)
        for b, m in enumerate(maps):
            if not isinstance(m, torch.Tensor) or m.dim() != 2 or m.layout is not torch.strided or m.is_nested or \
                    m.is_floating_point() or m.is_complex():
                raise invalid_argument(f"maps[{b}]", "a 2-D [nq_b, nk_b] bool (or integer) tensor", _describe(m))
        if q_offsets is None:
            raise invalid_argument("q_offsets", "the batch's offsets (each map's shape is checked against its "
                                   "sequence's lengths)", "None")
        q_lengths, kv_lengths, device = _sides(q_offsets, kv_offsets)
        if len(maps) != len(q_lengths):
            raise invalid_argument("maps", f"{len(q_lengths)} maps (B of q_offsets)", len(maps))
        for b, (m, lq, lk) in enumerate(zip(maps, q_lengths, kv_lengths)):
            if tuple(m.shape) != (blocks_of(lq), blocks_of(lk)):
                raise invalid_argument(f"maps[{b}]", f"shape ({blocks_of(lq)}, {blocks_of(lk)}) = "
                                                     f"(ceil({lq} / 128), ceil({lk} / 128))", tuple(m.shape))
        blocks = torch.cat([m.reshape(-1).to(device) != 0 for m in maps]) if maps else \
            torch.zeros(0, dtype=torch.bool, device=device)
        return cls(blocks.to(torch.uint8), _csr([m.numel() for m in maps], device))

    @classmethod
    def from_fn(cls, fn: Callable[[Tensor, Tensor, Tensor], Any], q_offsets: Tensor,
                kv_offsets: Optional[Tensor] = None) -> "BlockMask":
        """fn(b, q_block, kv_block) -> bool, called once over index tensors (int64, one entry per
        map entry of the whole batch: b the sequence, q_block and kv_block the block indices
        within it), returning a bool tensor broadcastable to theirs (or a Python bool).
        FlexAttention's create_block_mask at block granularity; fn may index per-sequence lookup
        tensors with b. kv_offsets None: q's (self-attention). On q_offsets' device."""
        if not callable(fn):
            raise invalid_argument("fn", "a function fn(b, q_block, kv_block) -> bool tensor", type(fn).__name__)
        q_lengths, kv_lengths, device = _sides(q_offsets, kv_offsets)
        b_idx, q_idx, kv_idx, counts = _block_indices(q_lengths, kv_lengths, device)
        result = fn(b_idx, q_idx, kv_idx)
        if isinstance(result, bool):
            result = torch.full(b_idx.shape, result, dtype=torch.bool, device=device)
        if not isinstance(result, torch.Tensor) or result.dtype != torch.bool:
            raise invalid_argument("fn(b, q_block, kv_block)", f"a bool tensor broadcastable to ({b_idx.numel()},)",
                                   _describe(result))
        try:
            result = torch.broadcast_to(result, b_idx.shape)
        except RuntimeError:
            raise invalid_argument("fn(b, q_block, kv_block)", f"a bool tensor broadcastable to ({b_idx.numel()},)",
                                   _describe(result)) from None
        return cls(result.to(device=device, dtype=torch.uint8).contiguous(), _csr(counts, device))

    @classmethod
    def full(cls, q_offsets: Tensor, kv_offsets: Optional[Tensor] = None) -> "BlockMask":
        """Every block visible: the same results as no block mask (for comparisons)."""
        return cls.from_fn(lambda b, i, j: True, q_offsets, kv_offsets)

    @classmethod
    def random(cls, q_offsets: Tensor, kv_offsets: Optional[Tensor] = None, *, density: float = 0.25,
               generator: Optional[torch.Generator] = None, seed: Optional[int] = None) -> "BlockMask":
        """Each block visible with probability `density` (in [0, 1]), drawn on the CPU from
        `generator` (or a fresh one seeded with `seed`), for tests and benchmarks."""
        if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0.0 <= density <= 1.0:
            raise invalid_argument("density", "a number in [0, 1]", repr(density))
        if generator is None:
            generator = torch.Generator()
            if seed is not None:
                generator.manual_seed(seed)
        q_lengths, kv_lengths, device = _sides(q_offsets, kv_offsets)
        counts = [blocks_of(lq) * blocks_of(lk) for lq, lk in zip(q_lengths, kv_lengths)]
        drawn = torch.rand(sum(counts), generator=generator) < density
        return cls(drawn.to(torch.uint8).to(device), _csr(counts, device))

    @classmethod
    def documents(cls, document_lengths: Sequence[Sequence[int]], q_offsets: Tensor,
                  kv_offsets: Optional[Tensor] = None,
                  kv_document_lengths: Optional[Sequence[Sequence[int]]] = None) -> "BlockMask":
        """Documents packed inside each sequence, attending only within themselves: sequence b is
        documents document_lengths[b] (token counts summing to its length), every one but the last
        a multiple of 128 tokens (block-aligned, so the map expresses the mask exactly). Query
        block i sees key block j when both belong to the same document. kv_document_lengths: the
        key side's documents (as many per sequence), None for the query side's (self-attention).
        Combine with causal=True for causal attention within each document."""
        q_lengths, kv_lengths, device = _sides(q_offsets, kv_offsets)
        if kv_document_lengths is None:
            if kv_offsets is not None and q_lengths != kv_lengths:
                raise invalid_argument("kv_document_lengths", "the key side's documents (q and kv lengths differ)",
                                       "None")
            kv_document_lengths = document_lengths
        q_doc = _block_documents("document_lengths", document_lengths, q_lengths)
        kv_doc = _block_documents("kv_document_lengths", kv_document_lengths, kv_lengths)
        for b in range(len(q_lengths)):
            if len(document_lengths[b]) != len(kv_document_lengths[b]):
                raise invalid_argument(f"kv_document_lengths[{b}]",
                                       f"{len(document_lengths[b])} documents (as document_lengths[{b}])",
                                       len(kv_document_lengths[b]))
        q_ids = torch.tensor([d for seq in q_doc for d in seq], dtype=torch.int64, device=device)
        kv_ids = torch.tensor([d for seq in kv_doc for d in seq], dtype=torch.int64, device=device)
        q_base = torch.tensor(_exclusive([len(s) for s in q_doc]), dtype=torch.int64, device=device)
        kv_base = torch.tensor(_exclusive([len(s) for s in kv_doc]), dtype=torch.int64, device=device)
        return cls.from_fn(lambda b, i, j: q_ids[q_base[b] + i] == kv_ids[kv_base[b] + j], q_offsets, kv_offsets)

    @classmethod
    def prefix_lm(cls, prefix_blocks: Any, q_offsets: Tensor, kv_offsets: Optional[Tensor] = None) -> "BlockMask":
        """Prefix-LM at block granularity: every query block sees sequence b's first
        prefix_blocks[b] key blocks (the prefix, attended bidirectionally) and, past them, the key
        blocks a causal mask reaches (key block j when some key in it is at or before some query of
        the query block, bottom-right aligned: j * 128 <= min(128 i + 127, Lq - 1) + Lk - Lq).
        Within a diagonal block every pair is visible (causal=True would cut the prefix too), so
        the mask is exact when the prefix ends on a block edge and causality is wanted between
        blocks. prefix_blocks: B ints >= 0 (a list or an integer tensor)."""
        q_lengths, kv_lengths, device = _sides(q_offsets, kv_offsets)
        if isinstance(prefix_blocks, torch.Tensor):
            if prefix_blocks.dim() != 1 or prefix_blocks.is_floating_point() or prefix_blocks.dtype == torch.bool:
                raise invalid_argument("prefix_blocks", f"{len(q_lengths)} ints >= 0 (one per sequence)",
                                       _describe(prefix_blocks))
            prefix_blocks = prefix_blocks.tolist()
        if not isinstance(prefix_blocks, (list, tuple)) or len(prefix_blocks) != len(q_lengths):
            got = len(prefix_blocks) if isinstance(prefix_blocks, (list, tuple)) else type(prefix_blocks).__name__
            raise invalid_argument("prefix_blocks", f"{len(q_lengths)} ints >= 0 (one per sequence)", got)
        for b, p in enumerate(prefix_blocks):
            if isinstance(p, bool) or not isinstance(p, int) or p < 0:
                raise invalid_argument(f"prefix_blocks[{b}]", "an int >= 0 (blocks of 128 keys)", repr(p))
        prefix = torch.tensor(prefix_blocks, dtype=torch.int64, device=device)
        lq = torch.tensor(q_lengths, dtype=torch.int64, device=device)
        lk = torch.tensor(kv_lengths, dtype=torch.int64, device=device)

        def visible(b, i, j):
            last_query = torch.minimum(i * BLOCK + BLOCK - 1, lq[b] - 1)
            return (j < prefix[b]) | (j * BLOCK <= last_query + lk[b] - lq[b])

        return cls.from_fn(visible, q_offsets, kv_offsets)


def _exclusive(counts: Sequence[int]) -> List[int]:
    out, total = [], 0
    for n in counts:
        out.append(total)
        total += n
    return out


def _block_indices(q_lengths: Sequence[int], kv_lengths: Sequence[int], device: torch.device):
    """(b, q_block, kv_block) int64 over every map entry of the batch in blocks' order, and the
    per-sequence entry counts."""
    nq = torch.tensor([blocks_of(n) for n in q_lengths], dtype=torch.int64)
    nk = torch.tensor([blocks_of(n) for n in kv_lengths], dtype=torch.int64)
    counts = nq * nk
    total = int(counts.sum()) if counts.numel() else 0
    b = torch.repeat_interleave(torch.arange(len(q_lengths), dtype=torch.int64), counts)
    starts = torch.cumsum(counts, 0) - counts
    r = torch.arange(total, dtype=torch.int64) - starts[b]
    cols = nk[b]
    q_block, kv_block = r // cols.clamp_min(1), r % cols.clamp_min(1)
    return b.to(device), q_block.to(device), kv_block.to(device), counts.tolist()


def _block_documents(name: str, document_lengths: Any, lengths: Sequence[int]) -> List[List[int]]:
    """Per sequence, the document index of each of its blocks; checks the documents (token counts
    summing to the sequence's length, all but the last a multiple of 128)."""
    if not isinstance(document_lengths, (list, tuple)) or len(document_lengths) != len(lengths):
        got = len(document_lengths) if isinstance(document_lengths, (list, tuple)) else type(document_lengths).__name__
        raise invalid_argument(name, f"{len(lengths)} lists of document lengths (one per sequence)", got)
    out = []
    for b, (docs, length) in enumerate(zip(document_lengths, lengths)):
        if isinstance(docs, torch.Tensor):
            docs = docs.tolist()
        if not isinstance(docs, (list, tuple)) or any(isinstance(d, bool) or not isinstance(d, int) or d < 0
                                                      for d in docs):
            raise invalid_argument(f"{name}[{b}]", "a list of token counts >= 0", repr(docs))
        if sum(docs) != length:
            raise invalid_argument(f"sum({name}[{b}])", f"sequence {b}'s length {length}", sum(docs))
        ids: List[int] = []
        for d, n in enumerate(docs):
            if d < len(docs) - 1 and n % BLOCK:
                raise invalid_argument(f"{name}[{b}][{d}]", f"a multiple of {BLOCK} tokens (documents but the last "
                                                            "end on a block edge)", n)
            ids.extend([d] * blocks_of(n))
        assert len(ids) == blocks_of(length)
        out.append(ids)
    return out
