"""The implementations compare.py runs side by side, each behind the same small interface:

    impl = make(name, inputs)          # may raise: the caller records why it could not run (Skip: a note)
    out = impl.forward()               # [T, H, D], differentiable in inputs.q/k/v (or padded copies)
    dq, dk, dv = impl.backward(out)    # gradients for inputs.dout, [T, ...] like q/k/v; out's graph kept
    out, (dq, dk, dv) = impl.step()    # a training step: forward, then backward through it once

All of them see the same q, k, v, dout and offsets (inputs). FlexAttention runs on copies padded to
one common length, so that it compiles once per (head dim, mask) instead of once per batch; its
block mask lists no block of the padding, so the padding costs it (almost) nothing.

FlashAttention-3 ("FA3 varlen") is a benchmark peer only, never a dependency: it runs when
`flash_attn_interface` imports (the prebuilt copy of shared/peers/fa3, carried to the GPU machine as
.fa3/ and put on PYTHONPATH by scripts/gpu-python.sh); fa3_import_error() says why not otherwise.

cuDNN ("cuDNN ragged") is torch's nested-tensor SDPA on cuDNN's ragged-offset kernels: forward
only, timed by its GPU kernels through torch.profiler rather than by events (CudnnRagged says why),
asked for by name (--impls), never run by default.
"""
import itertools
import os
from dataclasses import dataclass

import torch

import jagflash

CUDNN = "cuDNN ragged"
CUDNN_NESTED_ENV = "TORCH_CUDNN_SDPA_NESTED_TENSOR_ENABLED"
FA4 = "FA4 varlen"
PEERS = ("FA2 varlen", "FA3 varlen", "varlen_attn", "FlexAttention", CUDNN, FA4)
IMPLEMENTATIONS = ("jagflash",) + PEERS
# What a run takes without --impls: every implementation but cuDNN, whose calls spend tens of ms
# each on the host (its graph rebuilt) and a profiler session each: by estimate (not measured) a
# minute more over compare.py's 20 cases, which scripts/gpu-python.sh's time limit for compare.py
# does not leave room for; and FA4, which JIT-compiles each configuration at its first call and is
# carried to the GPU machine in three calls (shared/peers/fa4/README.md).
DEFAULT_IMPLEMENTATIONS = tuple(name for name in IMPLEMENTATIONS if name not in (CUDNN, FA4))
# What the backward bars of issues 13 and 14 compare (and the training step runs).
BAR_IMPLEMENTATIONS = ("jagflash", "FA2 varlen", "FA3 varlen")
_FLEX_BLOCK = 128


def impl_name(text):
    """An implementation's name as given on a command line: as spelled, or with _ for each space
    (cuDNN_ragged, FA3_varlen: names a shell variable such as COMPARE_ARGS can carry)."""
    return text if text in IMPLEMENTATIONS else text.replace("_", " ")


class Skip(Exception):
    """An implementation that does not take this case (or whose output was wrong, so it was not
    timed): the message says why, and the table shows a note instead of a figure. Not a failure
    of the run."""


@dataclass
class Inputs:
    q: torch.Tensor  # [T, H, D] leaves that require grad
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    offsets: torch.Tensor  # int32 [B+1] on the device (self-attention: q and kv share them)
    lengths: list
    causal: bool
    flex_length: int  # the common padded length of every batch of this run (a multiple of 128)

    @property
    def max_len(self):
        return max(self.lengths, default=0)


def offsets_of(lengths, device):
    """The int32 [B+1] offsets of a batch's lengths, on the device (what every implementation takes)."""
    return torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32, device=device)


def benchmark_batch(dist, head_dim, generator, heads=16, uniform=False):
    """A distribution's batch as the bench scripts draw it: (lengths, offsets, [q, k, v, dout]) with
    the shared generator's lengths (fixed seed), int32 offsets on the generator's device, and bf16
    [total, heads, head_dim] tensors from N(0, 1) (compare.py's draw) or, with uniform, U(-1, 1)."""
    lengths = jagflash.generate_lengths(dist, jagflash.DEFAULT_SEED)
    device = generator.device
    shape = (sum(lengths), heads, head_dim)

    def draw():
        if uniform:
            return (torch.rand(shape, generator=generator, device=device) * 2 - 1).to(torch.bfloat16)
        return torch.randn(shape, generator=generator, device=device).to(torch.bfloat16)

    return lengths, offsets_of(lengths, device), [draw() for _ in range(4)]


class _Implementation:
    def unpad(self, out, grads):
        """out and gradients as [T, H, D] tensors (only FlexAttention has something to undo)."""
        return out, grads

    def step(self):
        """One training step's attention: the forward, then the backward through it once (its
        graph freed, as in training)."""
        out = self.forward()
        return out, self.backward(out, retain_graph=False)


class _Autograd(_Implementation):
    """backward() through torch.autograd; by default the forward graph is kept for the next
    repetition."""

    def backward(self, out, retain_graph=True):
        return torch.autograd.grad(out, self.leaves, self.dout, retain_graph=retain_graph)


class Jagflash(_Autograd):
    def __init__(self, x):
        self.x, self.leaves, self.dout = x, (x.q, x.k, x.v), x.dout

    def forward(self):
        # "device": no host sync per call, like the peers (which check nothing). max_seqlen: the
        # longest sequence, which FA2 and varlen_attn are given too (their API requires it).
        return jagflash.jagged_attention(self.x.q, self.x.k, self.x.v, self.x.offsets, causal=self.x.causal,
                                         check_offsets="device", max_seqlen_q=self.x.max_len)


class FlashAttention2(_Implementation):
    """aten._flash_attention_forward / _backward called directly (the kernels behind SDPA's varlen path)."""

    def __init__(self, x):
        if not x.q.is_cuda:
            raise RuntimeError("needs CUDA")
        self.x = x

    def forward(self):
        x = self.x
        out, self.lse, self.rng_state, self.unused, _ = torch.ops.aten._flash_attention_forward(
            x.q.detach(), x.k.detach(), x.v.detach(), x.offsets, x.offsets, x.max_len, x.max_len, 0.0, x.causal, False
        )
        return out

    def backward(self, out, retain_graph=True):  # no autograd graph to keep: aten takes forward()'s lse
        x = self.x
        return torch.ops.aten._flash_attention_backward(
            x.dout, x.q.detach(), x.k.detach(), x.v.detach(), out, self.lse, x.offsets, x.offsets, x.max_len,
            x.max_len, 0.0, x.causal, self.rng_state, self.unused,
        )


def fa3_import_error():
    """None when FlashAttention-3's flash_attn_interface imports, else why not (one line)."""
    try:
        import flash_attn_interface  # noqa: F401
    except Exception as e:  # noqa: BLE001 - a missing module, or a build that does not load here
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
    return None


class FlashAttention3(_Autograd):
    """flash_attn_interface.flash_attn_varlen_func (FA3's varlen path; autograd for the backward)."""

    # What the prebuilt copy holds (shared/peers/fa3/README.md): bf16, head dims up to 128
    # (65-128 on the 128 kernels), no sliding window, sm_90a.
    MAX_HEAD_DIM = 128

    def __init__(self, x):
        import flash_attn_interface

        if not x.q.is_cuda:
            raise RuntimeError("needs CUDA")
        if x.q.dtype != torch.bfloat16 or x.q.shape[-1] > self.MAX_HEAD_DIM:
            raise RuntimeError(f"the FA3 build carried has bf16 and D <= {self.MAX_HEAD_DIM} only")
        self.x, self.leaves, self.dout = x, (x.q, x.k, x.v), x.dout
        self.fn = flash_attn_interface.flash_attn_varlen_func

    def forward(self):
        x = self.x
        out = self.fn(x.q, x.k, x.v, x.offsets, x.offsets, x.max_len, x.max_len, causal=x.causal)
        return out[0] if isinstance(out, tuple) else out  # some FA3 versions return (out, lse)


class FlashAttention4(_Autograd):
    """flash_attn.cute.flash_attn_varlen_func (FlashAttention-4, CuTe DSL, flash-attn-4 on PyPI):
    a benchmark peer only, asked for by name (--impls FA4_varlen) where shared/peers/fa4 was
    installed on the GPU machine; its first call of a configuration compiles it (seconds), which the
    warm-up calls absorb."""

    def __init__(self, x):
        from flash_attn.cute import flash_attn_varlen_func

        if not x.q.is_cuda:
            raise RuntimeError("needs CUDA")
        self.x, self.leaves, self.dout = x, (x.q, x.k, x.v), x.dout
        self.fn = flash_attn_varlen_func

    def forward(self):
        x = self.x
        max_len = int(x.max_len)  # FA4 takes Python ints
        out = self.fn(x.q, x.k, x.v, cu_seqlens_q=x.offsets, cu_seqlens_k=x.offsets, max_seqlen_q=max_len,
                      max_seqlen_k=max_len, causal=x.causal)
        return out[0] if isinstance(out, tuple) else out  # (out, lse)


class VarlenAttn(_Autograd):
    """torch.nn.attention.varlen.varlen_attn (a custom op with its own autograd)."""

    def __init__(self, x):
        from torch.nn.attention.varlen import varlen_attn

        if not x.q.is_cuda:
            raise RuntimeError("needs CUDA")
        self.x, self.fn, self.leaves, self.dout = x, varlen_attn, (x.q, x.k, x.v), x.dout

    def forward(self):
        x = self.x
        return self.fn(x.q, x.k, x.v, x.offsets, x.offsets, x.max_len, x.max_len,
                       window_size=(-1, 0) if x.causal else (-1, -1))


# FlexAttention's mask functions read the document ids of the current batch from here. The
# functions stay the same objects and the tensors keep one shape (the common padded length), so
# the compiled kernels are reused for every batch: one compilation per (head dim, mask).
_flex_state = {}


def _doc_mask(b, h, q_idx, kv_idx):
    return _flex_state["q_doc"][q_idx] == _flex_state["kv_doc"][kv_idx]


def _doc_causal_mask(b, h, q_idx, kv_idx):
    # Lq == Lk per document and both sides start at the same offset: bottom-right causal is q >= kv.
    return (_flex_state["q_doc"][q_idx] == _flex_state["kv_doc"][kv_idx]) & (q_idx >= kv_idx)


def _doc_ids(lengths, length, pad_id, device):
    """Document id per token, padded to `length` with pad_id (q and kv pad differently, so padding
    never sees padding)."""
    ids = torch.full((length,), pad_id, dtype=torch.int32, device=device)
    counts = torch.tensor(lengths, dtype=torch.int64, device=device)
    total = int(sum(lengths))
    ids[:total] = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32, device=device), counts)
    return ids


def _ordered(blocks):
    """Dense [nq, nk] bool -> (num [1, 1, nq], indices [1, 1, nq, nk]) int32, listed blocks first."""
    num = blocks.sum(dim=-1, dtype=torch.int32)
    indices = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return num[None, None].contiguous(), indices[None, None].contiguous()


def document_block_mask(lengths, length, causal, device):
    """A BlockMask for self-attention within documents, built from the lengths at block level
    (never a token x token matrix): a block pair is listed when some document has tokens in both
    (and, causal, the kv block does not start after the q block ends); it is full (no mask_mod
    needed) when both blocks lie inside one document, without padding, and (causal) strictly
    below the diagonal."""
    from torch.nn.attention.flex_attention import BlockMask

    q_doc = _doc_ids(lengths, length, -1, device)
    kv_doc = _doc_ids(lengths, length, -2, device)
    _flex_state["q_doc"], _flex_state["kv_doc"] = q_doc, kv_doc
    per_block = q_doc.view(-1, _FLEX_BLOCK)
    real = per_block >= 0
    big = torch.iinfo(torch.int32).max
    lo = torch.where(real, per_block, big).amin(dim=1)  # first document in the block (big: none)
    hi = torch.where(real, per_block, -1).amax(dim=1)  # last document in the block (-1: none)
    has_tokens = hi >= 0
    overlap = (lo[:, None] <= hi[None, :]) & (lo[None, :] <= hi[:, None]) & has_tokens[:, None] & has_tokens[None, :]
    one_doc = has_tokens & real.all(dim=1) & (lo == hi)
    full = one_doc[:, None] & one_doc[None, :] & (lo[:, None] == lo[None, :])
    if causal:
        n = per_block.shape[0]
        idx = torch.arange(n, device=device)
        overlap &= idx[None, :] <= idx[:, None]
        full &= idx[None, :] < idx[:, None]
    partial = overlap & ~full
    return BlockMask.from_kv_blocks(*_ordered(partial), *_ordered(full), BLOCK_SIZE=_FLEX_BLOCK,
                                    mask_mod=_doc_causal_mask if causal else _doc_mask, seq_lengths=(length, length))


_compiled_flex = {}


def _flex_attention(compile_flex):
    from torch.nn.attention.flex_attention import flex_attention

    if not compile_flex:
        return flex_attention
    if "fn" not in _compiled_flex:
        _compiled_flex["fn"] = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex["fn"]


class FlexAttention(_Autograd):
    def __init__(self, x, compile_flex=True):
        total, heads, head_dim = x.q.shape
        self.total = total

        def padded(t):
            p = torch.zeros((x.flex_length, heads, head_dim), dtype=t.dtype, device=t.device)
            p[:total] = t.detach()
            return p.requires_grad_(t.requires_grad)

        self.leaves = tuple(padded(t) for t in (x.q, x.k, x.v))
        self.dout_padded = torch.zeros((x.flex_length, heads, head_dim), dtype=x.dout.dtype, device=x.dout.device)
        self.dout_padded[:total] = x.dout
        # [T, H, D] -> [1, H, T, D] views: flex reads strided inputs.
        self.dout = self.dout_padded.unsqueeze(0).transpose(1, 2)
        self.block_mask = document_block_mask(x.lengths, x.flex_length, x.causal, x.q.device)
        self.fn = _flex_attention(compile_flex)

    def forward(self):
        q, k, v = (t.unsqueeze(0).transpose(1, 2) for t in self.leaves)
        return self.fn(q, k, v, block_mask=self.block_mask)

    def unpad(self, out, grads):
        return out[0].transpose(0, 1)[: self.total], tuple(g[: self.total] for g in grads)


def enable_cudnn_nested():
    """Lets torch hand nested inputs to cuDNN: its environment variable set to 1 unless the
    environment already has a value (which cudnn_ragged_unavailable() then reports). torch reads
    it once, the first time any SDPA call asks whether cuDNN may take nested inputs (a static in
    sdp_utils.cpp), so this must run before the process's first SDPA call: compare.py and
    sweep.py call it (through skip_unavailable) before they measure anything, and only when
    cuDNN is in the run."""
    os.environ.setdefault(CUDNN_NESTED_ENV, "1")


def cudnn_ragged_unavailable(device):
    """None when cuDNN's ragged SDPA can run in this process on `device`, else why not (one
    line): what a whole run skips it for. What torch decides per case (lengths, layout) comes out
    of the first call of each case instead."""
    from torch.nn.attention import SDPBackend

    value = os.environ.get(CUDNN_NESTED_ENV)
    if value != "1":
        return (f"{CUDNN_NESTED_ENV}={value!r} in the environment; torch takes nested inputs to cuDNN "
                "only with 1, read at its first SDPA call")
    if not hasattr(torch.nested, "nested_tensor_from_jagged") or not hasattr(SDPBackend, "CUDNN_ATTENTION"):
        return f"torch {torch.__version__} has no jagged nested tensors or no cuDNN SDPA backend"
    if torch.device(device).type != "cuda":
        return "needs a CUDA device"
    if not torch.backends.cudnn.is_available():
        return f"torch {torch.__version__} was built without cuDNN"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in (9, 10):  # torch's check_for_nested_inputs
        return f"torch runs cuDNN's nested SDPA on sm_90 and sm_100 only, not sm_{major}{minor}"
    return None


def causal_alignment_skip(causal, q_lengths, kv_lengths):
    """Why a causal case cannot be compared (None when it can). cuDNN's is_causal keeps the
    diagonal at the top left of each sequence's score matrix, jagflash's (and FA2's, FA3's) at
    the bottom right; the two are the same mask only where every sequence has Lq == Lk, as in
    self-attention."""
    if not causal:
        return None
    differ = sum(1 for lq, lk in zip(q_lengths, kv_lengths) if lq != lk) + abs(len(q_lengths) - len(kv_lengths))
    if differ:
        return (f"causal with Lq != Lk in {differ} sequence(s): cuDNN's causal mask is top-left aligned, "
                "jagflash's bottom-right")
    return None


class CudnnRagged(_Implementation):
    """scaled_dot_product_attention of jagged nested tensors under sdpa_kernel(CUDNN_ATTENTION):
    torch hands the packed [T, H, D] buffers and the offsets to cuDNN's ragged-offset SDPA
    (aten._cudnn_attention_forward), which is what TransformerEngine users get for packed
    sequences.

    Forward only: on ragged inputs its backward returns wrong dq / dk in torch 2.11 (PyTorch
    PR 186142), so backward() refuses. It is timed by its GPU kernels (compare.measure_kernels,
    the `timer` below) rather than by events around queued calls: torch rebuilds its cuDNN graph
    on every call, tens of ms on the host, so an event-timed call would measure the host."""

    timer = "profiler"
    # torch's nested path (_check_head_dim_size_cudnn_nested): same D for q, k, v, a multiple of 8,
    # at most 128.
    MAX_HEAD_DIM = 128

    def __init__(self, x, backend=None):
        from torch.nn.attention import SDPBackend

        head_dim = x.q.shape[-1]
        if head_dim % 8 or head_dim > self.MAX_HEAD_DIM:
            raise Skip(f"torch's nested cuDNN path takes head dims that are multiples of 8 up to "
                       f"{self.MAX_HEAD_DIM}, not {head_dim}")
        # Self-attention: q and kv share one offsets tensor, so their lengths are the same lists.
        reason = causal_alignment_skip(x.causal, x.lengths, x.lengths)
        if reason:
            raise Skip(reason)
        self.x = x
        self.backend = SDPBackend.CUDNN_ATTENTION if backend is None else backend
        # min/max given, so that torch never reads them back from the device (a sync per call).
        bounds = {"min_seqlen": min(x.lengths, default=0), "max_seqlen": x.max_len}

        def nested(t):  # [T, H, D] -> [B, H, j, D], a view of the same buffer
            return torch.nested.nested_tensor_from_jagged(t.detach(), x.offsets, **bounds).transpose(1, 2)

        self.q, self.k, self.v = nested(x.q), nested(x.k), nested(x.v)

    def forward(self):
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel(self.backend):
            out = torch.nn.functional.scaled_dot_product_attention(self.q, self.k, self.v, is_causal=self.x.causal)
        return out.transpose(1, 2).values()  # [B, H, j, D] -> the packed [T, H, D]

    def backward(self, out, retain_graph=True):
        raise NotImplementedError("cuDNN ragged is a forward peer only: its ragged backward is wrong in torch 2.11")

    def step(self):
        return self.backward(None)


def make(name, inputs, compile_flex=True):
    if name == "jagflash":
        return Jagflash(inputs)
    if name == "FA2 varlen":
        return FlashAttention2(inputs)
    if name == "FA3 varlen":
        return FlashAttention3(inputs)
    if name == "varlen_attn":
        return VarlenAttn(inputs)
    if name == "FlexAttention":
        return FlexAttention(inputs, compile_flex)
    if name == CUDNN:
        return CudnnRagged(inputs)
    if name == FA4:
        return FlashAttention4(inputs)
    raise ValueError(f"unknown implementation {name!r}")
