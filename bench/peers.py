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

A model's layer (bench/models.py) adds to the plain self-attention of Inputs: GQA (k, v with fewer
heads), a v head dim of its own, a causal sliding window, a tanh softcap, learnable sinks, and
cross-attention (q's own lengths), pooled attention among it (one query set shared by every
sequence: jagflash.pooled_attention, the others given it repeated per sequence). An implementation
that lacks one of these raises Skip naming what it lacks in words ("no softcap, no D=256").
"""
import dataclasses
import inspect
import itertools
import os
from dataclasses import dataclass
from typing import Optional

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
    # What a model's layer adds; the defaults are plain self-attention. lengths and offsets are
    # kv's; q_lengths / q_offsets, when given, q's own (cross-attention).
    q_lengths: Optional[list] = None
    q_offsets: Optional[torch.Tensor] = None
    window_left: int = -1  # with causal: each query sees itself and this many keys before it (-1: all)
    softcap: float = 0.0  # a tanh softcap on the scaled scores (0: none)
    sinks: Optional[torch.Tensor] = None  # learnable sink logits, fp32 [H], a leaf like q, k, v
    query_set: bool = False  # pooled: q is one [Lq, H, D] set shared by the sequences (q_lengths all Lq)

    @property
    def max_len(self):
        return max(self.lengths, default=0)

    @property
    def max_len_q(self):
        return max(self.q_lengths, default=0) if self.q_lengths is not None else self.max_len

    @property
    def cu_q(self):
        """q's offsets: its own (cross-attention), else the offsets q and kv share."""
        return self.offsets if self.q_offsets is None else self.q_offsets

    @property
    def cross(self):
        return self.q_offsets is not None

    def leaves(self):
        """What the gradients are taken of: q, k, v, and the sinks when the layer has them."""
        return (self.q, self.k, self.v) + (() if self.sinks is None else (self.sinks,))


OWN_V_HEAD_DIM = "Dv ≠ D"  # a v head dim other than q's and k's (DeepSeek's MLA: 192 / 128)


def features(x):
    """The features of a case beyond plain attention, in the words a refusal gives ("no ...")."""
    found = []
    if x.softcap:
        found.append("softcap")
    if x.window_left >= 0:
        found.append("sliding window")
    if x.sinks is not None:
        found.append("sinks")
    if x.k.shape[1] != x.q.shape[1]:
        found.append("GQA")
    if x.v.shape[-1] != x.q.shape[-1]:
        found.append(OWN_V_HEAD_DIM)
    return found


def lacking(x, lacks, max_head_dim=None):
    """In words, every feature of the case that an implementation lacks (lacks: feature names as
    features() gives them; max_head_dim: the largest q head dim it takes): ["no softcap", "no D=256"]."""
    missing = [f"no {name}" for name in features(x) if name in lacks]
    head_dim = x.q.shape[-1]
    if max_head_dim is not None and head_dim > max_head_dim:
        missing.append(f"no D={head_dim}")
    return missing


def refuse_lacking(x, lacks, max_head_dim=None, build=""):
    """Skip naming what lacking() finds, if anything (build: where, e.g. " in this FA3 build")."""
    missing = lacking(x, lacks, max_head_dim)
    if missing:
        raise Skip(", ".join(missing) + build)


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


def jagflash_has_sinks():
    """Whether this build's jagged_attention takes learnable sinks (learnable_sink=)."""
    return "learnable_sink" in inspect.signature(jagflash.jagged_attention).parameters


def _layer_options(x):
    """The keyword arguments of a layer's window, softcap and sinks, only those it has, in the
    names jagflash and FlashAttention-4 share (window: FlashAttention's (left, right))."""
    options = {}
    if x.window_left >= 0:
        options["window"] = (x.window_left, 0)
    if x.softcap:
        options["softcap"] = x.softcap
    if x.sinks is not None:
        options["learnable_sink"] = x.sinks
    return options


class Jagflash(_Autograd):
    def __init__(self, x):
        if x.sinks is not None and not jagflash_has_sinks():
            raise Skip("no sinks in this build")
        self.x, self.leaves, self.dout = x, x.leaves(), x.dout
        self.options = _layer_options(x)
        if x.cross:
            self.options.update(kv_offsets=x.offsets, max_seqlen_kv=x.max_len)

    def forward(self):
        # "device": no host sync per call, like the peers (which check nothing). max_seqlen: the
        # longest sequence, which FA2 and varlen_attn are given too (their API requires it).
        return jagflash.jagged_attention(self.x.q, self.x.k, self.x.v, self.x.cu_q, causal=self.x.causal,
                                         check_offsets="device", max_seqlen_q=self.x.max_len_q, **self.options)


class JagflashPooled(_Autograd):
    """jagflash.pooled_attention: the query set [Lq, H, D] taken once for every sequence."""

    def __init__(self, x):
        if x.sinks is not None and not jagflash_has_sinks():
            raise Skip("no sinks in this build")
        self.x, self.leaves, self.dout = x, x.leaves(), x.dout
        self.options = _layer_options(x)

    def forward(self):
        return jagflash.pooled_attention(self.x.q, self.x.k, self.x.v, self.x.offsets, check_offsets="device",
                                         **self.options)


class FlashAttention2(_Implementation):
    """aten._flash_attention_forward / _backward called directly (the kernels behind SDPA's varlen path).
    Its kernels take one head dim for q, k and v: a narrower v is zero-padded to q's (and dout in the
    backward), in the timed calls, as a caller of FA2 does, and the padding cut off the results."""

    MAX_HEAD_DIM = 256

    def __init__(self, x):
        refuse_lacking(x, ("softcap", "sinks"), self.MAX_HEAD_DIM)
        if not x.q.is_cuda:
            raise RuntimeError("needs CUDA")
        self.x = x
        self.v_pad = x.q.shape[-1] - x.v.shape[-1]
        self.note = f"v zero-padded to D = {x.q.shape[-1]} (one head dim for q, k, v)" if self.v_pad else None
        # Only a layer with a window passes the window's arguments (a plain call stays as it was).
        self.window = {} if x.window_left < 0 else {"window_size_left": x.window_left, "window_size_right": 0}

    def _padded(self, t):
        return torch.nn.functional.pad(t, (0, self.v_pad)) if self.v_pad else t

    def forward(self):
        x = self.x
        out, self.lse, self.rng_state, self.unused, _ = torch.ops.aten._flash_attention_forward(
            x.q.detach(), x.k.detach(), self._padded(x.v.detach()), x.cu_q, x.offsets, x.max_len_q, x.max_len, 0.0,
            x.causal, False, **self.window
        )
        self.padded_out = out  # what the backward reads (out's columns past Dv are zeros)
        return out[..., :x.v.shape[-1]] if self.v_pad else out

    def backward(self, out, retain_graph=True):  # no autograd graph to keep: aten takes forward()'s lse
        x = self.x
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            self._padded(x.dout), x.q.detach(), x.k.detach(), self._padded(x.v.detach()), self.padded_out, self.lse,
            x.cu_q, x.offsets, x.max_len_q, x.max_len, 0.0, x.causal, self.rng_state, self.unused, **self.window
        )
        return dq, dk, dv[..., :x.v.shape[-1]] if self.v_pad else dv


def _import_error(module):
    """None when `module` imports, else why not (one line)."""
    try:
        __import__(module)
    except Exception as e:  # noqa: BLE001 - a missing module, or a build that does not load here
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
    return None


def fa3_import_error():
    """None when FlashAttention-3's flash_attn_interface imports, else why not (one line)."""
    return _import_error("flash_attn_interface")


def fa4_import_error():
    """None when FlashAttention-4's flash_attn.cute imports, else why not (one line)."""
    return _import_error("flash_attn.cute")


class FlashAttention3(_Autograd):
    """flash_attn_interface.flash_attn_varlen_func (FA3's varlen path; autograd for the backward)."""

    # What the prebuilt copy holds (shared/peers/fa3/README.md): bf16, head dims up to 128
    # (65-128 on the 128 kernels), no sliding window, no softcap, no v head dim of its own, sm_90a.
    # Sinks are in no FA3 (its interface has no argument for them).
    MAX_HEAD_DIM = 128

    def __init__(self, x):
        import flash_attn_interface

        refuse_lacking(x, ("sinks",))
        refuse_lacking(x, ("softcap", "sliding window", OWN_V_HEAD_DIM), self.MAX_HEAD_DIM, " in this FA3 build")
        if not x.q.is_cuda:
            raise RuntimeError("needs CUDA")
        if x.q.dtype != torch.bfloat16:
            raise RuntimeError("the FA3 build carried has bf16 only")
        self.x, self.leaves, self.dout = x, (x.q, x.k, x.v), x.dout
        self.fn = flash_attn_interface.flash_attn_varlen_func

    def forward(self):
        x = self.x
        out = self.fn(x.q, x.k, x.v, x.cu_q, x.offsets, x.max_len_q, x.max_len, causal=x.causal)
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
        self.x, self.leaves, self.dout = x, x.leaves(), x.dout
        self.fn = flash_attn_varlen_func

    def forward(self):
        x = self.x
        options = _layer_options(x)  # FA4 takes softcap and learnable_sink by these names too
        if "window" in options:
            options["window_size"] = options.pop("window")
        # FA4 takes Python ints
        out = self.fn(x.q, x.k, x.v, cu_seqlens_q=x.cu_q, cu_seqlens_k=x.offsets, max_seqlen_q=int(x.max_len_q),
                      max_seqlen_k=int(x.max_len), causal=x.causal, **options)
        return out[0] if isinstance(out, tuple) else out  # (out, lse)


class VarlenAttn(_Autograd):
    """torch.nn.attention.varlen.varlen_attn (a custom op with its own autograd)."""

    def __init__(self, x):
        from torch.nn.attention.varlen import varlen_attn

        refuse_lacking(x, ("softcap", "sinks", OWN_V_HEAD_DIM))
        if not x.q.is_cuda:
            raise RuntimeError("needs CUDA")
        self.x, self.fn, self.leaves, self.dout = x, varlen_attn, (x.q, x.k, x.v), x.dout

    def forward(self):
        x = self.x
        return self.fn(x.q, x.k, x.v, x.cu_q, x.offsets, x.max_len_q, x.max_len,
                       window_size=(x.window_left, 0) if x.causal else (-1, -1))


# FlexAttention's mask functions read the document ids of the current batch from here. The
# functions stay the same objects and the tensors keep one shape (the common padded length), so
# the compiled kernels are reused for every batch: one compilation per (head dim, mask).
_flex_state = {}


def _doc_mask(b, h, q_idx, kv_idx):
    return _flex_state["q_doc"][q_idx] == _flex_state["kv_doc"][kv_idx]


def _doc_causal_mask(b, h, q_idx, kv_idx):
    # Lq == Lk per document and both sides start at the same offset: bottom-right causal is q >= kv.
    return (_flex_state["q_doc"][q_idx] == _flex_state["kv_doc"][kv_idx]) & (q_idx >= kv_idx)


def _doc_causal_window_mask(b, h, q_idx, kv_idx):
    return _doc_causal_mask(b, h, q_idx, kv_idx) & (q_idx - kv_idx <= _flex_state["window_left"])


def _mask_mod(causal, window_left):
    if not causal:
        return _doc_mask
    return _doc_causal_mask if window_left < 0 else _doc_causal_window_mask


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


def _block_documents(doc):
    """Per block of a side's document ids: (first document, last document, has tokens, lies inside
    one document without padding)."""
    per_block = doc.view(-1, _FLEX_BLOCK)
    real = per_block >= 0
    big = torch.iinfo(torch.int32).max
    lo = torch.where(real, per_block, big).amin(dim=1)  # first document in the block (big: none)
    hi = torch.where(real, per_block, -1).amax(dim=1)  # last document in the block (-1: none)
    has_tokens = hi >= 0
    return lo, hi, has_tokens, has_tokens & real.all(dim=1) & (lo == hi)


def document_block_mask(lengths, length, causal, device, q_lengths=None, q_length=None, window_left=-1):
    """A BlockMask for attention within documents, built from the lengths at block level (never a
    token x token matrix): a block pair is listed when some document has tokens in both (and,
    causal, the kv block does not start after the q block ends; with a window, does not end before
    the window of the q block's first row starts); it is full (no mask_mod needed) when both blocks
    lie inside one document, without padding, (causal) strictly below the diagonal and (window)
    with every pair inside the window. lengths / length are kv's (and q's in self-attention);
    q_lengths / q_length q's own (cross-attention, not causal)."""
    from torch.nn.attention.flex_attention import BlockMask

    q_lengths = lengths if q_lengths is None else q_lengths
    q_length = length if q_length is None else q_length
    q_doc = _doc_ids(q_lengths, q_length, -1, device)
    kv_doc = _doc_ids(lengths, length, -2, device)
    _flex_state.update(q_doc=q_doc, kv_doc=kv_doc, window_left=window_left)
    q_lo, q_hi, q_has, q_one = _block_documents(q_doc)
    kv_lo, kv_hi, kv_has, kv_one = _block_documents(kv_doc)
    overlap = (q_lo[:, None] <= kv_hi[None, :]) & (kv_lo[None, :] <= q_hi[:, None]) & q_has[:, None] & kv_has[None, :]
    full = q_one[:, None] & kv_one[None, :] & (q_lo[:, None] == kv_lo[None, :])
    q_first = torch.arange(q_lo.shape[0], device=device)[:, None] * _FLEX_BLOCK  # first row of each block
    kv_first = torch.arange(kv_lo.shape[0], device=device)[None, :] * _FLEX_BLOCK
    if causal:
        overlap &= kv_first <= q_first
        full &= kv_first < q_first
    if causal and window_left >= 0:
        last = _FLEX_BLOCK - 1
        overlap &= q_first - (kv_first + last) <= window_left  # the closest pair inside the window
        full &= (q_first + last) - kv_first <= window_left  # the farthest pair too
    partial = overlap & ~full
    return BlockMask.from_kv_blocks(*_ordered(partial), *_ordered(full), BLOCK_SIZE=_FLEX_BLOCK,
                                    mask_mod=_mask_mod(causal, window_left), seq_lengths=(q_length, length))


_compiled_flex = {}


def _flex_attention(compile_flex):
    from torch.nn.attention.flex_attention import flex_attention

    if not compile_flex:
        return flex_attention
    if "fn" not in _compiled_flex:
        _compiled_flex["fn"] = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex["fn"]


def _padded(t, length, grad=True):
    """t [T, ...] copied into zeros [length, ...] (a leaf when t requires grad and grad is on)."""
    p = torch.zeros((length, *t.shape[1:]), dtype=t.dtype, device=t.device)
    p[: t.shape[0]] = t.detach()
    return p.requires_grad_(grad and t.requires_grad)


class FlexAttention(_Autograd):
    """A layer's features as FlexAttention has them: the window in the mask_mod (and the block
    mask), the softcap as a score_mod, GQA through enable_gqa, and the sinks through its lse: a sink
    s_h joins the softmax's denominator, so out = flex's out * exp(lse) / (exp(lse) + exp(s_h)) =
    flex's out * sigmoid(lse - s_h), differentiable in the sinks through autograd."""

    def __init__(self, x, compile_flex=True):
        if x.cross and x.causal:
            raise Skip("causal cross-attention is not built here")
        # torch's FlexAttention refuses inputs that require grad on the CPU: a forward there.
        self.no_backward = None if x.q.is_cuda else "FlexAttention has no backward on CPU"
        grad = self.no_backward is None
        self.total_q, self.total_kv = x.q.shape[0], x.k.shape[0]
        q_length = -(-self.total_q // _FLEX_BLOCK) * _FLEX_BLOCK if x.cross else x.flex_length
        self.leaves = tuple(_padded(t, n, grad) for t, n in ((x.q, q_length), (x.k, x.flex_length),
                                                              (x.v, x.flex_length)))
        self.sinks = x.sinks
        if x.sinks is not None:
            self.leaves += (x.sinks,)
        self.dout_padded = _padded(x.dout, q_length, grad=False)
        # [T, H, D] -> [1, H, T, D] views: flex reads strided inputs.
        self.dout = self.dout_padded.unsqueeze(0).transpose(1, 2)
        self.block_mask = document_block_mask(x.lengths, x.flex_length, x.causal, x.q.device,
                                              x.q_lengths if x.cross else None, q_length, x.window_left)
        self.fn = _flex_attention(compile_flex)
        self.options = {}  # only a layer's own: a plain call stays as it was
        if x.softcap:
            cap = x.softcap

            def softcap(score, b, h, q_idx, kv_idx):
                return cap * torch.tanh(score / cap)

            self.options["score_mod"] = softcap
        if x.k.shape[1] != x.q.shape[1]:
            self.options["enable_gqa"] = True

    def forward(self):
        q, k, v = (t.unsqueeze(0).transpose(1, 2) for t in self.leaves[:3])
        if self.sinks is None:
            return self.fn(q, k, v, block_mask=self.block_mask, **self.options)
        from torch.nn.attention.flex_attention import AuxRequest

        out, aux = self.fn(q, k, v, block_mask=self.block_mask, return_aux=AuxRequest(lse=True), **self.options)
        # lse [1, H, T] (natural log; -inf on padding rows, whose out is 0 either way).
        return (out * torch.sigmoid(aux.lse - self.sinks[:, None]).unsqueeze(-1)).to(out.dtype)

    def backward(self, out, retain_graph=True):
        if self.no_backward:
            raise NotImplementedError(self.no_backward)
        return super().backward(out, retain_graph)

    def unpad(self, out, grads):
        """out [T, H, Dv] and (dq, dk, dv[, dsinks]) without the padding rows."""
        if grads:
            dq, dk, dv, *rest = grads
            grads = (dq[: self.total_q], dk[: self.total_kv], dv[: self.total_kv], *rest)
        return out[0].transpose(0, 1)[: self.total_q], grads


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
    no_backward = "forward only (its ragged backward is wrong in torch 2.11)"
    # torch's nested path (_check_head_dim_size_cudnn_nested): same D for q, k, v, a multiple of 8,
    # at most 128; the same number of heads for q, k, v when training (no GQA: torch's
    # _check_num_heads_nested); no softcap, window or sinks in SDPA's arguments.
    MAX_HEAD_DIM = 128

    def __init__(self, x, backend=None):
        from torch.nn.attention import SDPBackend

        missing = lacking(x, ("softcap", "sliding window", "sinks", "GQA", OWN_V_HEAD_DIM), self.MAX_HEAD_DIM)
        head_dim = x.q.shape[-1]
        if head_dim % 8 or missing == [f"no D={head_dim}"]:  # the head dim alone: say what it takes
            raise Skip(f"torch's nested cuDNN path takes head dims that are multiples of 8 up to "
                       f"{self.MAX_HEAD_DIM}, not {head_dim}")
        if missing:
            raise Skip(", ".join(missing) + " in torch's nested cuDNN path")
        q_lengths = x.lengths if x.q_lengths is None else x.q_lengths
        reason = causal_alignment_skip(x.causal, q_lengths, x.lengths)
        if reason:
            raise Skip(reason)
        self.x = x
        self.backend = SDPBackend.CUDNN_ATTENTION if backend is None else backend

        def nested(t, offsets, lengths):  # [T, H, D] -> [B, H, j, D], a view of the same buffer
            # min/max given, so that torch never reads them back from the device (a sync per call).
            return torch.nested.nested_tensor_from_jagged(t.detach(), offsets, min_seqlen=min(lengths, default=0),
                                                          max_seqlen=max(lengths, default=0)).transpose(1, 2)

        self.q = nested(x.q, x.cu_q, q_lengths)
        self.k, self.v = nested(x.k, x.offsets, x.lengths), nested(x.v, x.offsets, x.lengths)

    def forward(self):
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel(self.backend):
            out = torch.nn.functional.scaled_dot_product_attention(self.q, self.k, self.v, is_causal=self.x.causal)
        return out.transpose(1, 2).values()  # [B, H, j, D] -> the packed [T, H, D]

    def backward(self, out, retain_graph=True):
        raise NotImplementedError("cuDNN ragged is a forward peer only: its ragged backward is wrong in torch 2.11")

    def step(self):
        return self.backward(None)


class QueryRepeated(_Implementation):
    """A peer without pooled attention on a pooled case: it takes the query set repeated per
    sequence ([B*Lq, H, D], cu_seqlens_q = b*Lq) as a leaf of its own, made once (the repeat, and
    the sum of dq over the copies, are not in its timed calls: bench/models.py times them apart);
    unpad() sums dq over the copies, to compare with jagflash's [Lq, H, D]."""

    def __init__(self, peer, query_rows):
        self.peer, self.query_rows = peer, query_rows
        self.timer = getattr(peer, "timer", None)
        self.note = getattr(peer, "note", None)
        self.no_backward = getattr(peer, "no_backward", None)

    def forward(self):
        return self.peer.forward()

    def backward(self, out, retain_graph=True):
        return self.peer.backward(out, retain_graph)

    def unpad(self, out, grads):
        out, grads = self.peer.unpad(out, grads)
        if grads:
            grads = (grads[0].unflatten(0, (-1, self.query_rows)).sum(0), *grads[1:])
        return out, grads


def query_repeated(x):
    """A pooled case's inputs as a peer without pooled attention takes them: q repeated per sequence."""
    q = x.q.detach().repeat(len(x.lengths), 1, 1).requires_grad_(x.q.requires_grad)
    return dataclasses.replace(x, q=q, query_set=False)


def make(name, inputs, compile_flex=True):
    if inputs.query_set:
        if name == "jagflash":
            return JagflashPooled(inputs)
        return QueryRepeated(make(name, query_repeated(inputs), compile_flex), inputs.q.shape[0])
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
