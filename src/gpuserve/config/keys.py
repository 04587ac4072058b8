"""Suggestions for unknown configuration keys: ``max_batch_sise`` -> ``max_batch_size``.

Config sections refuse unknown keys (a typo must not be silently ignored); this module finds
the valid name nearest to the one given, with :mod:`difflib`, so the error can say
``did you mean 'max_batch_size'?``. It walks the pydantic models along the error's location
(``dynamic_batching.max_queue_delay_uss``, ``inputs.0.nam``) to the section the key was
given in, and compares with that section's fields only.
"""

from __future__ import annotations

import difflib
import typing
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

#: How alike a key must be to a valid name to be suggested (difflib's ratio, 0..1).
CUTOFF = 0.6


def section_fields(model: type[BaseModel], path: Sequence[int | str]) -> list[str] | None:
    """The field names of the config section at ``path`` under ``model``, or None when
    ``path`` does not lead to a section (a free-form mapping such as ``parameters``).

    Args:
        model: The root model (``ModelConfig``).
        path: The location of the section: field names, with list indices (ints) and
            pydantic's union tags (model class names) allowed in between.
    """
    current: type[BaseModel] | None = model
    for part in path:
        if current is None:
            return None
        if isinstance(part, int) or part == current.__name__:
            continue
        field = current.model_fields.get(str(part))
        if field is None:
            return None
        current = _model_in(field.annotation)
    if current is None:
        return None
    names = []
    for name, field in current.model_fields.items():
        names.append(name)
        if isinstance(field.alias, str) and field.alias != name:
            names.append(field.alias)
    return names


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside an annotation (``X``, ``X | None``, ``list[X]``,
    ``dict[str, X]``), or None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def nearest(key: str, valid: Sequence[str]) -> str | None:
    """The valid name nearest to ``key``, or None when none is close (difflib)."""
    lowered = {name.lower(): name for name in valid}
    match = difflib.get_close_matches(key.lower(), list(lowered), n=1, cutoff=CUTOFF)
    return lowered[match[0]] if match else None


def unknown_key_hint(model: type[BaseModel], loc: Sequence[int | str]) -> str:
    """The text to add to pydantic's "Extra inputs are not permitted" for the key at ``loc``:
    ``; did you mean 'max_batch_size'?``, else the section's valid names, else ``""``."""
    if not loc:
        return ""
    key = str(loc[-1])
    valid = section_fields(model, loc[:-1])
    if not valid:
        return ""
    guess = nearest(key, valid)
    if guess is not None:
        return f"; did you mean '{guess}'?"
    return f"; the fields here are: {', '.join(sorted(set(valid)))}"
