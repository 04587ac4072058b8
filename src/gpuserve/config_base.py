"""The base of every configuration section."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    """Base for config sections: unknown keys are errors, so typos are caught at load."""

    model_config = ConfigDict(extra="forbid", frozen=True)
