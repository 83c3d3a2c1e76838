"""The field machinery of the config tree (megatron_trace/config.py) and of the quantization policy
(models/quant_policy.py, whose fields the tree's `quant` section is generated from): `opt(...)`
declares a field's default, help, allowed values and lower bound; a `Section` (a dataclass, frozen
or not) coerces and checks every field by its annotation and that metadata when built (`coerce`, the
one validator), then runs its cross-field `check`; `build` makes a section from a YAML/CLI mapping,
`Raw` marks a command-line string to be parsed by the type of the field it lands in."""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import field
from typing import Any, ClassVar

import yaml


def opt(default, help: str, choices: tuple | None = None, low: float | None = None):
    """A field with its help text, allowed values and lower bound (checked at load)."""
    meta = {"help": help, "choices": choices, "low": low}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


class Section:
    """Base of the tree's sections: built = coerced and checked (see the module docstring)."""

    SECTION: ClassVar[str] = ""

    def __post_init__(self) -> None:
        hints = hints_of(type(self))
        for f in dataclasses.fields(self):
            key = f"{self.SECTION}.{f.name}"
            # object.__setattr__: a frozen section (the quantization policy) is coerced the same way
            object.__setattr__(self, f.name, coerce(key, hints[f.name], f.metadata, getattr(self, f.name)))
        self.check()

    def check(self) -> None:
        """Cross-field rules of the section (the per-field ones are declarations)."""


@functools.cache
def hints_of(cls) -> dict:
    return typing.get_type_hints(cls)


def build(section: str, cls, values: dict):
    if not isinstance(values, dict):
        raise ValueError(f"config section {section!r} must be a mapping; got {type(values).__name__}")
    fields_ = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields_))
    if unknown:
        raise ValueError(f"unknown keys {[f'{section}.{k}' for k in unknown]}; allowed: {sorted(fields_)}")
    return cls(**values)  # the section's constructor coerces and checks every value


class Raw(str):
    """A command-line value, parsed by the type of the field it lands in."""


def coerce(key: str, typ, meta, value):
    """`value` as the field `key` declares it (annotation `typ`, metadata choices/low), or a
    ValueError naming the key and what is allowed."""
    if isinstance(value, Raw):
        value = str(value) if typ is str else (yaml.safe_load(value) if value else "")
    if typ is str and isinstance(value, bool):  # YAML 1.1 reads off/on/yes/no as booleans
        word = {False: "off", True: "on"}[value]
        if meta.get("choices") and word in meta["choices"]:
            value = word
        else:
            raise ValueError(f"{key} must be a string; YAML read {value!r} (quote it)")
    if typ is float and isinstance(value, str):  # YAML 1.1 reads 3e-4 as a string
        try:
            value = float(value)
        except ValueError:
            raise ValueError(f"{key} must be a number; got {value!r}") from None
    if typing.get_origin(typ) is tuple:  # a YAML list held as a tuple (the policy's targets)
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{key} must be a list; got {value!r} ({type(value).__name__})")
        value = tuple(value)
    elif typ is Any:
        pass
    elif typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    elif typ is list and isinstance(value, tuple):
        value = list(value)
    elif not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ValueError(f"{key} must be {typ.__name__}; got {value!r} ({type(value).__name__})")
    choices = meta.get("choices")
    if choices and value not in choices:
        raise ValueError(f"{key} must be one of {', '.join(map(str, choices))}; got {value!r}")
    low = meta.get("low")
    if low is not None and value < low:
        raise ValueError(f"{key} must be >= {low}; got {value!r}")
    return value
