"""``fxmeg export --format hf --check``: does the exported directory give the checkpoint's
model?

The reference is the checkpoint's own model on one device: the transformers class and
config recorded in the checkpoint (``meta.json``), its tensors loaded with
``load_state_dict`` as ``fxmeg export --format pt`` writes them, no fxmeg code in the way.
The export is what a user gets: ``AutoModelForCausalLM.from_pretrained(DIR)``. The check
compares, in this order, and stops at the first difference:

1. the tensors: every entry of the export's state_dict against the checkpoint's, exactly
   (the same bytes went through safetensors), and none missing on either side;
2. the logits of a few token sequences (fixed seed), both models in the export's dtype;
3. ``generate()`` as the export's generation_config sets it (greedy here): it must keep a
   key/value cache, and the logits of each token it adds, computed over that cache,
   must be those of a forward over the whole sequence.
"""

from __future__ import annotations

import torch

from fxmeg.errors import CheckpointError
from fxmeg.interop.hf_export import model_class
from fxmeg.weights.checkpoint import read_model

SEQUENCES, LENGTH = 2, 16
LOGITS_RTOL = 1e-5
"""Of the largest |logit|: the same weights and kernels give the same logits to rounding."""
CACHE_RTOL = 1e-4
"""Of the largest |logit|: attention over a cache sums in another order than over the window."""
NEW_TOKENS = 4


class ExportMismatch(CheckpointError):
    """An export that does not give the checkpoint's model (``fxmeg export --check``)."""


def check(checkpoint: str, directory: str) -> list[str]:
    """Compare the Hugging Face export ``directory`` with checkpoint ``checkpoint``; the
    comparison, one line per step. Raises ExportMismatch naming the first tensor or
    logits that differ, with the max abs and rel difference."""
    import transformers

    path, meta, state = read_model(checkpoint)
    exported, info = transformers.AutoModelForCausalLM.from_pretrained(
        directory, output_loading_info=True
    )
    exported.eval()
    where = f"export check of {directory} against {path}"
    again = f"export again with fxmeg export {path} --to {directory} --format hf"
    lines = [_tensors(exported, info, state, where, again)]
    reference = _reference(meta, state, exported, where)
    ids = _sequences(meta, exported.config)
    with torch.no_grad():
        want, got = reference(input_ids=ids).logits, exported(input_ids=ids).logits
        lines.append(
            _compare(
                got,
                want,
                LOGITS_RTOL,
                f"logits of {SEQUENCES} sequences x {ids.shape[1]} tokens",
                where,
                fix="the export's config.json differs from the trained model's",
            )
        )
    lines.append(_generation(exported, ids[:, : LENGTH // 2], where))
    return lines


def _tensors(exported, info: dict, state: dict[str, torch.Tensor], where: str, again: str) -> str:
    """Every tensor of the export equal to the checkpoint's; the line that says so."""
    missing = sorted(set(info.get("missing_keys") or ()) | set(info.get("mismatched_keys") or ()))
    if missing:
        raise ExportMismatch(
            f"{where}: from_pretrained found no usable tensor for {missing[0]!r} "
            f"({len(missing)} in all: {', '.join(map(str, missing[:3]))}) and initialised it at "
            f"random; {again}"
        )
    own = exported.state_dict()
    extra = sorted(set(own) - set(state)) + sorted(set(info.get("unexpected_keys") or ()))
    if extra:
        raise ExportMismatch(
            f"{where}: the export has {extra[0]!r}, which the checkpoint's model does not "
            f"({len(extra)} such); {again}"
        )
    for name, got in own.items():
        want = state[name]
        if got.shape != want.shape or not torch.equal(got.to(want.dtype), want):
            raise ExportMismatch(f"{where}: tensor {name!r} differs from the checkpoint's "
                                 f"({_difference(got, want)}); {again}")
    return f"tensors: {len(own)} equal to the checkpoint's, bit for bit"


def _reference(meta: dict, state: dict[str, torch.Tensor], exported, where: str) -> torch.nn.Module:
    """The checkpoint's model: its recorded class and config, its tensors, the export's
    dtype and attention."""
    import transformers

    config = dict(meta["hugging_face"]["config"])
    name, cls = model_class(config)
    if cls is None:
        raise ExportMismatch(
            f"{where}: the checkpoint's model class {name!r} is not in transformers "
            f"{transformers.__version__}; check with the transformers that trained it"
        )
    model = cls._from_config(cls.config_class.from_dict(config),
                             attn_implementation=exported.config._attn_implementation)
    model.load_state_dict(state, strict=True)
    return model.to(exported.dtype).eval()


def _sequences(meta: dict, config) -> torch.Tensor:
    """SEQUENCES rows of token ids the data could hold (below the tokenizer's size when
    the checkpoint records it), LENGTH long or the position table's length."""
    high = (meta.get("data") or {}).get("vocab_size") or config.vocab_size
    length = min(LENGTH, getattr(config, "max_position_embeddings", None) or LENGTH)
    return torch.randint(0, high, (SEQUENCES, length), generator=torch.Generator().manual_seed(0))


def _generation(model, prompt: torch.Tensor, where: str) -> str:
    """generate() keeps a key/value cache and its logits are the whole forward's."""
    with torch.no_grad():
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            return_dict_in_generate=True,
            output_logits=True,
        )
        # transformers 5 names the cache `cache` (earlier `past_key_values`)
        if out.get("cache" if "cache" in out else "past_key_values") is None:
            raise ExportMismatch(
                f"{where}: generate() kept no key/value cache; set use_cache true in "
                f"{model.name_or_path}/generation_config.json and config.json"
            )
        steps = torch.stack(out.logits, dim=1)  # (rows, new tokens, vocab): before suppress_tokens
        whole = model(input_ids=out.sequences[:, :-1]).logits[:, prompt.shape[1] - 1 :]
    return _compare(
        steps,
        whole,
        CACHE_RTOL,
        f"generate() over the key/value cache ({steps.shape[1]} tokens)",
        where,
        fix="generate() would not give the model's tokens; report it",
    )


def _compare(
    got: torch.Tensor, want: torch.Tensor, rtol: float, what: str, where: str, *, fix: str
) -> str:
    scale = want.abs().max().item()
    worst = (got.double() - want.double()).abs().max().item()
    if not worst <= rtol * max(scale, 1.0):
        raise ExportMismatch(
            f"{where}: {what} differ ({_difference(got, want)}; tolerance {rtol:g} of the "
            f"largest |logit| {scale:.4g}): {fix}"
        )
    return (
        f"{what}: max abs diff {worst:.3g} (largest |logit| {scale:.4g}, tolerance {rtol:g} of it)"
    )


def _difference(got: torch.Tensor, want: torch.Tensor) -> str:
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} vs {tuple(want.shape)}"
    delta = (got.double() - want.double()).abs()
    at = delta.argmax()
    rel = delta.flatten()[at].item() / max(want.double().abs().flatten()[at].item(), 1e-30)
    index = tuple(int(i) for i in torch.unravel_index(at, delta.shape))
    return f"max abs diff {delta.max().item():.4g} at {index}, rel {rel:.3g}"
