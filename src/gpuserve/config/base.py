"""The base of every configuration section."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    """Base for config sections: unknown keys are errors, so typos are caught at load."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def check_dims(shape: list[int]) -> list[int]:
    """A declared shape (no batch dimension): each dim a positive integer or -1 (variable).

    Raises:
        ValueError: a dim is 0 or below -1.
    """
    for dim in shape:
        if dim < -1 or dim == 0:
            raise ValueError(f"each dim must be a positive integer or -1, got {dim}")
    return shape
