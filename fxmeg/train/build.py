"""The trainer's model from ``--model module:Class`` and ``--model-args`` (a JSON object):
keyword arguments, the fields of the config dataclass the class takes, or a Hugging Face
class's config (``fxmeg.interop.hugging_face.build``)."""

from __future__ import annotations

import dataclasses
import importlib
import inspect

from torch import nn

from fxmeg.errors import ConfigError, closest
from fxmeg.interop import hugging_face

INJECTED = frozenset({"vocab_size", "seq_len"})
"""The model arguments the trainer adds itself: a config without such a field ignores them."""


def build_model(spec: str, args: dict) -> nn.Module:
    """module:Class built from ``args``: as keyword arguments, or as the fields of the
    config dataclass its constructor takes (a key it has no field for is a ConfigError,
    but for the trainer's own INJECTED ones); a Hugging Face class from its config_class
    (``hugging_face.build``: seq_len sets its position table)."""
    module, _, name = spec.partition(":")
    cls = getattr(importlib.import_module(module), name)
    if hugging_face.is_hugging_face(cls):
        return hugging_face.build(cls, args)
    params = [p for p in inspect.signature(cls).parameters.values() if p.name != "self"]
    if len(params) == 1 and dataclasses.is_dataclass(params[0].default):
        config_cls = type(params[0].default)
        known = [f.name for f in dataclasses.fields(config_cls)]
        unknown = [k for k in args if k not in known and k not in INJECTED]
        if unknown:
            raise ConfigError(
                f"--model-args {unknown[0]!r} is not a field of {config_cls.__name__} (the config "
                "of "
                f"{name})" + closest(unknown[0], known)
            )
        return cls(config_cls(**{k: v for k, v in args.items() if k in known}))
    return cls(**args)
