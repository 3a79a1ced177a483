"""A Hugging Face checkpoint in its saved names, read as the model's own tensors.

transformers 5 fuses some tensors while loading and splits them again while saving: a
Mixtral or Qwen3-MoE checkpoint holds each expert's projections apart
(``...experts.3.w1.weight``), the model one bank per projection
(``...mlp.experts.gate_up_proj``, [E, 2I, H]). ``converted(weights, model)`` wraps a checkpoint
so that it answers under the model's names. The names come from transformers itself
(``get_model_conversion_mapping`` and ``rename_source_key``: what ``from_pretrained`` would
do, by construction); the arithmetic is fxmeg's: a read of a box of a bank reads only the
experts' tensors, and their rows, that the box covers, so an expert-parallel rank opens its
own experts and nothing else.

Understood: renamings; converters whose operations are ``MergeModulelist(dim=0)`` (the
experts stacked on a new dim 0), optionally followed by ``Concatenate(dim=d)`` (the
sources end to end along ``d`` of the stacked tensor), or ``Concatenate`` alone. A tensor
the model needs that only another operation makes is refused by name when it is checked.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from fxmeg.errors import WeightsError
from fxmeg.weights.sharding import Box, view
from fxmeg.weights.sources import Request, Weights

FIX = ("load the model with from_pretrained and pass its state_dict() as weights=, or export it "
       "once in the model's own names (fxmeg export --format hf --names model)")


@dataclass
class _Fused:
    """A model tensor transformers makes from several checkpoint tensors."""

    target: str
    patterns: list[str]
    """The converter's source patterns, in concatenation order."""
    merged: bool
    """Each pattern matches one tensor per expert, stacked on a new dim 0."""
    concat: int | None
    """The dim of the fused tensor the patterns' tensors are laid end to end along."""
    unknown: str = ""
    """The operations fxmeg does not apply ('' when understood)."""
    parts: dict[tuple[int, int], str] = field(default_factory=dict)
    """(pattern index, expert or 0) -> checkpoint name."""

    def experts(self, weights: Weights) -> int:
        """E: the experts every pattern has, each exactly 0..E-1 (1 when not merged)."""
        if not self.merged:
            return 1
        found = [sorted(e for (k, e) in self.parts if k == i) for i in range(len(self.patterns))]
        n = len(found[0])
        if any(f != list(range(n)) for f in found):
            raise WeightsError(
                f"{weights.where}: {self.target!r} is made of one tensor per expert for each of "
                f"{self.patterns}, but the experts found are {found}; the checkpoint is incomplete"
            )
        return n

    def piece_shape(self, weights: Weights, k: int) -> tuple[int, ...]:
        """The shape of pattern ``k``'s tensors (every expert's alike)."""
        shapes = {tuple(weights.shape(n)[0]) for (i, _), n in self.parts.items() if i == k}
        if len(shapes) != 1:
            raise WeightsError(
                f"{weights.where}: the tensors of {self.patterns[k]!r} that make "
                f"{self.target!r} have different shapes {sorted(shapes)}"
            )
        return shapes.pop()

    def layout(self, weights: Weights) -> tuple[tuple[int, ...], list[tuple[int, int]], int]:
        """The fused shape, (offset, size) of each pattern along the concat dim, and that
        dim (0 without a concatenation)."""
        experts = self.experts(weights)
        pieces = [self.piece_shape(weights, k) for k in range(len(self.patterns))]
        stacked = [((experts,) if self.merged else ()) + s for s in pieces]
        if self.concat is None:
            return stacked[0], [(0, stacked[0][0] if stacked[0] else 1)], 0
        d, spans, at = self.concat % len(stacked[0]), [], 0
        for s in stacked:
            spans.append((at, s[d]))
            at += s[d]
        shape = stacked[0][:d] + (at,) + stacked[0][d + 1 :]
        return shape, spans, d


class ConvertedWeights(Weights):
    """``base`` answering under the model's names (see the module docstring)."""

    def __init__(self, base: Weights, renamed: dict[str, str], fused: dict[str, _Fused]) -> None:
        super().__init__(base.where)
        self.base = base
        self.renamed = renamed
        """Model name -> checkpoint name, for tensors read as they are."""
        self.fused = fused

    def names(self) -> set[str]:
        return set(self.renamed) | set(self.fused)

    def file(self, name: str) -> str:
        if name in self.fused:
            return self.base.file(next(iter(self.fused[name].parts.values())))
        return self.base.file(self.renamed.get(name, name))

    def shape(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        if name in self.renamed:
            return self.base.shape(self.renamed[name])
        if name not in self.fused:
            raise self._unknown(name)
        fused = self.fused[name]
        if fused.unknown:
            raise WeightsError(
                f"{self.where}: transformers makes {name!r} from {fused.patterns} with "
                f"{fused.unknown}, which fxmeg does not apply while reading; {FIX}"
            )
        dtype = self.base.shape(next(iter(fused.parts.values())))[1]
        return fused.layout(self.base)[0], dtype

    def fill(self, requests: Sequence[Request]) -> None:
        inner: list[Request] = []
        for name, out, pairs in requests:
            if name in self.fused:
                self.shape(name)  # refuses operations fxmeg does not apply
                for glob, local in pairs:
                    inner += self._pieces(self.fused[name], glob, view(out, local))
            else:
                inner.append((self.renamed.get(name, name), out, pairs))
            self.reads[name] += 1
        self.base.fill(inner)

    def _pieces(self, fused: _Fused, box: Box, dst: torch.Tensor) -> list[Request]:
        """Requests to ``base`` that fill ``dst`` (box ``box`` of the fused tensor) from
        the checkpoint tensors it covers: per expert in the box, per pattern whose span
        along the concat dim meets it."""
        offsets, sizes = box
        _, spans, d = fused.layout(self.base)
        experts = range(offsets[0], offsets[0] + sizes[0]) if fused.merged else [None]
        out: list[Request] = []
        for k, (at, n) in enumerate(spans):
            lo, hi = max(offsets[d], at), min(offsets[d] + sizes[d], at + n)
            if fused.concat is not None and lo >= hi:
                continue
            for e in experts:
                part_off = list(offsets)
                part_size = list(sizes)
                if fused.concat is not None:
                    part_off[d], part_size[d] = lo - at, hi - lo
                piece = dst
                if fused.concat is not None:
                    piece = piece.narrow(d, lo - offsets[d], hi - lo)
                if e is not None:
                    piece, part_off, part_size = piece.select(0, e - offsets[0]), part_off[1:], \
                        part_size[1:]
                source = fused.parts[(k, e if e is not None else 0)]
                full = ((0,) * piece.dim(), tuple(piece.shape))
                out.append((source, piece, [((tuple(part_off), tuple(part_size)), full)]))
        return out


def converted(weights: Weights, model: nn.Module) -> Weights:
    """``weights`` under ``model``'s names where ``model`` holds a Hugging Face model whose
    transformers conversion renames or fuses some of the checkpoint's tensors; ``weights``
    itself otherwise (no Hugging Face model, no conversion, or names that already match)."""
    from fxmeg.interop.hugging_face import is_hugging_face

    hf = next((m for m in model.modules() if is_hugging_face(m)), None)
    if hf is None:
        return weights
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        rename_source_key,
    )

    transforms = get_model_conversion_mapping(hf)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamed: dict[str, str] = {}
    fused: dict[str, _Fused] = {}
    for key in sorted(weights.names()):
        target, pattern = rename_source_key(key, renamings, converters)
        if pattern is None:
            renamed[target] = key
            continue
        converter = next(c for c in converters if pattern in c.source_patterns)
        if target not in fused:
            fused[target] = _describe(target, converter)
        _add_part(fused[target], pattern, key, weights)
    if not fused and all(k == v for k, v in renamed.items()):
        return weights
    return ConvertedWeights(weights, renamed, fused)


def _describe(target: str, converter) -> _Fused:
    """What ``converter``'s operations do, in fxmeg's terms (``unknown`` names the rest)."""
    ops = [(type(op).__name__, getattr(op, "dim", None)) for op in converter.operations]
    patterns = list(converter.source_patterns)
    merged = bool(ops) and ops[0] == ("MergeModulelist", 0)
    rest = ops[1:] if merged else ops
    if rest == [] and merged and len(patterns) == 1:
        return _Fused(target, patterns, True, None)
    # a concatenation of a config-given number of shards (num_shards_attribute) names its
    # sources by shard, not by expert: not understood
    if (len(rest) == 1 and rest[0][0] == "Concatenate" and rest[0][1] is not None
            and getattr(converter.operations[-1], "num_shards_attribute", None) is None):
        return _Fused(target, patterns, merged, rest[0][1])
    unknown = ", ".join(repr(op) for op in converter.operations)
    return _Fused(target, patterns, merged, None, unknown=unknown)


def _add_part(fused: _Fused, pattern: str, key: str, weights: Weights) -> None:
    k = fused.patterns.index(pattern)
    expert = 0
    if fused.merged:
        regex = re.escape(pattern).replace(r"\*", r"(\d+)")
        match = re.search(regex, key)
        if match is None or not match.groups():
            raise WeightsError(
                f"{weights.where}: {key!r} matches {pattern!r}, but fxmeg cannot read its "
                f"expert index; {FIX}"
            )
        expert = int(match.group(1))
    fused.parts[(k, expert)] = key


# ---------------------------------------------------------------- the other way: as saved


@dataclass(frozen=True)
class SavedPart:
    """One tensor ``save_pretrained`` writes for a model tensor: its name, and which part of
    the model tensor it is (``expert`` None and ``dim`` None: the whole tensor)."""

    name: str
    expert: int | None = None
    """The index along dim 0 (a bank's expert)."""
    dim: int | None = None
    """The fused tensor's concat dim the part spans ``start``..``start + size`` of."""
    start: int = 0
    size: int = 0

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """This part of the model tensor ``tensor`` (a view)."""
        if self.dim is not None:
            tensor = tensor.narrow(self.dim, self.start, self.size)
        return tensor if self.expert is None else tensor.select(0, self.expert)


def saved_layout(
    shapes: dict[str, tuple[int, ...]], model: nn.Module
) -> list[tuple[str, list[SavedPart]]]:
    """What ``save_pretrained`` of ``model`` (a transformers model, e.g. built on meta)
    writes for tensors of these names and shapes (the model's names, tied ones left out):
    per model name, in the order transformers writes them, the saved tensors it becomes.

    The names are transformers' own: its conversion mapping reversed
    (``reverse_transform``, matched with its ``apply_converters`` and ``apply_renamings``
    as ``revert_weight_conversion`` does); the parts are ``_describe``'s reading of the
    forward operations, undone: a bank split per expert along dim 0, a concatenation cut
    into equal parts along its dim (transformers' ``Chunk``).

    Requires: ``model`` is what the tensors were trained as (its class and config).
    Ensures: each model tensor is covered by its parts exactly once; the names in
    ``shapes``' order when the model has no conversion (transformers then writes its
    state_dict as it is), else in transformers' (``dot_natural_key``); a name no converter
    matches becomes one SavedPart (whole, renamed if a renaming matches). Raises
    WeightsError naming the tensor and the operations for a conversion fxmeg does not
    undo, or a concatenation its parts do not divide."""
    from transformers.core_model_loading import (
        PrefixChange,
        WeightConverter,
        WeightRenaming,
        apply_converters,
        apply_renamings,
        dot_natural_key,
    )

    forward = _conversions(model, PrefixChange)
    pairs = [(t, t.reverse_transform()) for t in reversed(forward)]  # sub-models' first
    renamings = [r for _, r in pairs if isinstance(r, WeightRenaming)]
    converters = [(f, r) for f, r in pairs if isinstance(r, WeightConverter)]
    out = []
    # transformers sorts the names only when it has conversions to revert
    for name in sorted(shapes, key=dot_natural_key) if forward else shapes:
        layer, pattern = apply_converters(name, [r for _, r in converters])
        if pattern is None:
            out.append((name, [SavedPart(apply_renamings(name, renamings))]))
            continue
        fwd, rev = next((f, r) for f, r in converters if pattern in r.source_patterns)
        parts = _parts(name, shapes[name], _describe(name, fwd), layer, rev.target_patterns)
        out.append((name, [SavedPart(apply_renamings(p.name, renamings), p.expert, p.dim,
                                     p.start, p.size) for p in parts]))
    return out


def _conversions(model: nn.Module, prefix_change: type) -> list:
    """transformers' conversion mapping of ``model`` as ``save_pretrained`` reverses it for
    a model not loaded with from_pretrained: no legacy renamings, no prefix changes."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    found = get_model_conversion_mapping(model, add_legacy=False)
    return [t for t in found if not isinstance(t, prefix_change)]


def _parts(name: str, shape: tuple[int, ...], fused: _Fused, layer: str,
           targets: list[str]) -> list[SavedPart]:
    """The saved parts of model tensor ``name`` that ``fused`` describes: for each source
    pattern (in order), for each expert, as transformers' reversed operations emit them.
    ``layer`` is ``name`` with the first pattern in place (transformers' renamed key)."""
    if fused.unknown:
        raise WeightsError(
            f"{name!r}: transformers saves it as {targets} with the reverse of "
            f"{fused.unknown}, which fxmeg does not apply while exporting; {EXPORT_FIX}"
        )
    experts = range(shape[0]) if fused.merged else [None]
    dim, size = None, 0
    if fused.concat is not None:
        dim = fused.concat % len(shape)
        size, rest = divmod(shape[dim], len(targets))
        if rest:
            raise WeightsError(
                f"{name!r} {tuple(shape)}: transformers saves it cut into {len(targets)} equal "
                f"parts along dim {dim} ({targets}), which {shape[dim]} is not divisible "
                f"into; {EXPORT_FIX}"
            )
    parts = []
    for k, target in enumerate(targets):
        for e in experts:
            saved = target if e is None else target.replace("*", str(e))
            parts.append(SavedPart(layer.replace(targets[0], saved, 1), e, dim,
                                   k * size if dim is not None else 0, size))
    return parts


EXPORT_FIX = ("export with names='model' (fxmeg export --names model) to write the model's own "
              "tensors, which from_pretrained also loads")
