"""Megatron's per-sample fields of a GPT sample (``GPTDataset.__getitem__``): tokens and
labels (the window of seq_len + 1 tokens shifted by one), the loss mask, position ids and
the attention mask, with Megatron's three switches:

  eod_mask_loss         the loss skips positions whose *input* token is end-of-document
  reset_position_ids    positions count from 0 again after every end-of-document token
  reset_attention_mask  a token attends only to earlier tokens of its own document (the
                        documents packed in one sample do not see each other)

A label equal to the pad id never counts (the padding of a short last sample); pad ids in
tokens and labels become 0. The attention mask is True where attention is *masked*
(Megatron's convention), shape (1, s, s).
"""

from __future__ import annotations

import numpy as np


def gpt_fields(text: np.ndarray, *, eod: int, pad: int, eod_mask_loss: bool = False,
               reset_position_ids: bool = False, reset_attention_mask: bool = False,
               create_attention_mask: bool = True) -> dict[str, np.ndarray]:
    """The fields of the sample ``text`` (seq_len + 1 token ids); the (1, s, s) attention
    mask only with ``create_attention_mask`` (Megatron's switch of the same name: a caller
    that does not use it skips s * s work per sample)."""
    text = np.asarray(text, dtype=np.int64)
    tokens, labels = text[:-1].copy(), text[1:].copy()
    s = len(tokens)
    ends = tokens == eod
    loss_mask = np.ones(s, dtype=np.float32)
    if eod_mask_loss:
        loss_mask[ends] = 0.0
    # each position's document: the number of end-of-document tokens strictly before it
    document = np.concatenate([[0], np.cumsum(ends)[:-1]])
    # where each position's document starts
    first = np.concatenate([[0], np.flatnonzero(ends) + 1])[document]
    position_ids = np.arange(s, dtype=np.int64) - (first if reset_position_ids else 0)
    loss_mask[labels == pad] = 0.0
    tokens[tokens == pad] = 0
    labels[labels == pad] = 0
    out = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}
    if create_attention_mask:
        causal = np.tril(np.ones((s, s), dtype=bool))
        if reset_attention_mask:
            causal &= document[:, None] == document[None, :]
        out["attention_mask"] = ~causal[None]
    return out
