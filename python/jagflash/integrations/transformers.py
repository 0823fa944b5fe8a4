"""jagflash as an attention implementation of Hugging Face transformers (5.x).

    import jagflash.integrations.transformers as jf_transformers
    jf_transformers.register()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation=jf_transformers.register())

The name is "jagged_attention", not "jagflash": transformers 5.x takes any implementation whose
name contains "flash" for a FlashAttention kernel to load from its hub (utils/generic.py,
is_flash_attention_requested), and refuses the model when none is found there.

register() adds the name to transformers' AttentionInterface (the attention itself) and to its
AttentionMaskInterface (which mask the model builds for it). The mask builder is transformers'
own one for FlashAttention: a [batch, kv_length] padding mask, or None when nothing is padded.
Without that second registration transformers builds no mask at all for a name it does not know,
and padded batches would silently attend to their padding.

What a model passes and what jagflash runs (the same cases as transformers' FlashAttention path):
- cu_seq_lens_q / cu_seq_lens_k (+ max_length_q / max_length_k), as DataCollatorWithFlattening
  gives them: the batch is one packed row; the offsets go to jagflash as they are, so this path
  reads nothing on the host.
- a padding attention_mask: the kept tokens are gathered into a jagged batch, run, and scattered
  back into [B, S] rows (padded query rows get zeros, as with FlashAttention).
- position_ids that restart inside a row (several documents packed into one row): each restart
  starts a sequence. Finding the restarts reads position_ids on the host (one sync a forward: the
  offsets are kept for the next layers while the same position_ids tensor comes again).
- otherwise every row is one sequence.
Causal masks are bottom-right aligned when queries are fewer than keys (a KV cache), as in
transformers. sliding_window w sees the w - 1 previous tokens and itself (transformers' window
counts the token itself); softcap and scaling are the module's. s_aux, the attention sinks gpt-oss
passes (one logit per query head, (num_heads,), the module's parameter), is jagflash's
learnable_sink: it joins every row's softmax denominator and gets its gradient.
"""
from typing import Any, Optional, Tuple

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

from .._errors import JagflashError, invalid_argument, reworded, unsupported
from ..functional import jagged_attention

NAME = "jagged_attention"


def register() -> str:
    """Registers jagflash with transformers' attention and mask interfaces; returns the name,
    "jagged_attention", for attn_implementation=. Calling it again changes nothing."""
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, flash_attention_mask)
    return NAME


# jagged_attention's names -> the attention interface's, so an error names what the model passed.
_TRANSFORMERS_TERMS = ((r"^learnable_sink\b", "s_aux"),)


def _attention(*args: Any, **options: Any) -> Tensor:
    """jagged_attention (looked up when called: the tests wrap it), its errors in the interface's terms."""
    try:
        return jagged_attention(*args, **options)
    except JagflashError as error:
        raise reworded(error, _TRANSFORMERS_TERMS) from None


def _int_hint(value: Any) -> Optional[int]:
    """A max length as jagflash's hint: Python ints only. A tensor would need a host read to
    become one, so it is dropped (the hint changes speed, never results)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _row_offsets(batch: int, length: int, device: torch.device) -> Tensor:
    """Offsets of `batch` rows of `length` tokens each, made on the device (no host read)."""
    return torch.arange(0, (batch + 1) * length, length, dtype=torch.int32, device=device)


# The packed offsets of the last position_ids seen: every layer of a forward gets the same tensor,
# so the host read happens once a forward, not once a layer. The tensor itself is held so that
# its memory cannot be reused by another one; _version changes when it is written in place.
_last_position_ids: Optional[Tuple[Tensor, int, int, Tensor]] = None


def _offsets_from_position_ids(position_ids: Tensor, batch: int) -> Tensor:
    """Offsets [n+1] of the sequences in position_ids [batch or 1, S], flattened row after row: a
    sequence starts at each row's first token and wherever a position is not the previous one
    plus 1 (a packed document restarting at 0)."""
    global _last_position_ids
    cached = _last_position_ids
    if cached is not None and cached[0] is position_ids and cached[1] == position_ids._version and \
            cached[2] == batch:
        return cached[3]
    rows = position_ids.expand(batch, -1)
    starts = torch.ones_like(rows, dtype=torch.bool)
    starts[:, 1:] = rows[:, 1:] != rows[:, :-1] + 1
    flat = starts.reshape(-1)
    offsets = torch.cat([flat.nonzero().reshape(-1), flat.new_tensor([flat.numel()], dtype=torch.long)])
    offsets = offsets.to(torch.int32)
    _last_position_ids = (position_ids, position_ids._version, batch, offsets)
    return offsets


def _check_padding_mask(mask: Any, batch: int, kv_length: int) -> Tensor:
    if not isinstance(mask, Tensor) or mask.dim() != 2 or mask.shape[0] != batch or mask.shape[1] < kv_length:
        given = f"a tensor of shape {tuple(mask.shape)}" if isinstance(mask, Tensor) else type(mask).__name__
        raise unsupported("attention_mask", f"None or a 2D padding mask [batch={batch}, kv_length={kv_length}] "
                                            f"(the mask transformers builds for attn_implementation={NAME!r} once "
                                            "jagflash.integrations.transformers.register() has run)", given)
    # The mask may cover more keys than this layer holds (a sliding-window cache): its last ones are ours.
    return mask[:, -kv_length:].to(torch.bool)


def attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    is_causal: Optional[bool] = None,
    s_aux: Optional[Tensor] = None,
    position_ids: Optional[Tensor] = None,
    cu_seq_lens_q: Optional[Tensor] = None,
    cu_seq_lens_k: Optional[Tensor] = None,
    max_length_q: Optional[int] = None,
    max_length_k: Optional[int] = None,
    **kwargs: Any,
) -> Tuple[Tensor, None]:
    """transformers' attention interface: query [B, H, Sq, D], key and value [B, H_kv, Sk, D]
    (H % H_kv == 0); returns (attn_output [B, Sq, H, Dv], None) as transformers' FlashAttention
    does (no attention weights). Other keyword arguments transformers passes are not used."""
    if dropout != 0:
        raise unsupported("dropout", "0.0: jagflash has no attention dropout (set the config's attention_dropout "
                                     "to 0.0)", repr(dropout))
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    batch, heads, q_length, head_dim = query.shape
    kv_length = key.shape[2]
    # jagflash's layout: [tokens, heads, head dim].
    q = query.transpose(1, 2).reshape(batch * q_length, heads, head_dim)
    k = key.transpose(1, 2).reshape(batch * kv_length, key.shape[1], key.shape[3])
    v = value.transpose(1, 2).reshape(batch * kv_length, value.shape[1], value.shape[3])

    if sliding_window is not None and sliding_window > 0:
        # transformers' window of w covers the token itself and w - 1 before it (and after it when
        # not causal, as its FlashAttention path does).
        window = (sliding_window - 1, 0 if is_causal else sliding_window - 1)
    else:
        window = (-1, 0 if is_causal else -1)
    options = dict(causal=bool(is_causal), window=window, scale=scaling,
                   softcap=softcap if softcap is not None and softcap > 0 else None, learnable_sink=s_aux)

    rows_q: Optional[Tensor] = None  # where each output row goes back to in [B * Sq], when unpadded
    if attention_mask is not None:
        keep_k = _check_padding_mask(attention_mask, batch, kv_length)
        keep_q = keep_k[:, -q_length:]  # queries are the last Sq tokens of each row
        rows_k = keep_k.reshape(-1).nonzero().reshape(-1)
        rows_q = keep_q.reshape(-1).nonzero().reshape(-1)
        zero = keep_k.new_zeros(1, dtype=torch.int32)
        kv_offsets = torch.cat([zero, keep_k.sum(1, dtype=torch.int32).cumsum(0, dtype=torch.int32)])
        q_offsets = torch.cat([zero, keep_q.sum(1, dtype=torch.int32).cumsum(0, dtype=torch.int32)])
        q, k, v = q.index_select(0, rows_q), k.index_select(0, rows_k), v.index_select(0, rows_k)
        out = _attention(q, k, v, q_offsets, kv_offsets, **options)
    elif cu_seq_lens_q is not None or cu_seq_lens_k is not None:
        if cu_seq_lens_q is None or cu_seq_lens_k is None:
            raise invalid_argument("cu_seq_lens_q, cu_seq_lens_k", "both tensors or both None",
                                   "only " + ("cu_seq_lens_q" if cu_seq_lens_q is not None else "cu_seq_lens_k"))
        out = _attention(q, k, v, cu_seq_lens_q, cu_seq_lens_k, max_seqlen_q=_int_hint(max_length_q),
                         max_seqlen_kv=_int_hint(max_length_k), **options)
    elif position_ids is not None and q_length == kv_length and q_length > 1:
        offsets = _offsets_from_position_ids(position_ids, batch)
        out = _attention(q, k, v, offsets, **options)
    else:
        out = _attention(q, k, v, _row_offsets(batch, q_length, q.device), _row_offsets(batch, kv_length, q.device),
                         max_seqlen_q=q_length, max_seqlen_kv=kv_length, **options)

    if rows_q is not None:
        # Padded query rows get zeros; index_copy carries the gradient to the kept rows.
        out = out.new_zeros(batch * q_length, *out.shape[1:]).index_copy(0, rows_q, out)
    return out.view(batch, q_length, *out.shape[1:]), None
