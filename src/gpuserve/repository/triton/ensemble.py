"""Triton's ``ensemble_scheduling`` (``platform: "ensemble"``) mapped onto gpuserve's
``ensemble`` section (:mod:`gpuserve.config.ensemble`)::

    ensemble_scheduling {
      step [
        { model_name: "tokenizer"  model_version: -1
          input_map  { key: "TEXT" value: "TEXT" }
          output_map { key: "INPUT_IDS" value: "ids" } }
      ]
    }

``input_map``/``output_map`` entries are ``key`` (the step model's tensor) -> ``value`` (the
ensemble's tensor), as in Triton; in the JSON form of a load request they are objects.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpuserve.repository.triton.pbtxt import Message

if TYPE_CHECKING:
    from gpuserve.repository.triton.config import _Mapper


def ensemble_section(mapper: _Mapper, msg: Message, backend: str) -> dict[str, Any]:
    """The ``ensemble`` section for Triton's ``ensemble_scheduling`` message ``msg`` of a
    model whose mapped backend is ``backend``.

    Raises:
        ConfigError: a field gpuserve does not serve, or a malformed map entry (names the
            file and the dotted field).
    """
    where = "ensemble_scheduling."
    if backend != "ensemble":
        raise mapper.fail(
            "ensemble_scheduling", 'needs platform "ensemble"', f"backend {backend!r}"
        )
    mapper.only(msg, {"step"}, where)
    steps = []
    for index, step in enumerate(mapper.subs(msg, "step", where)):
        at = f"{where}step[{index}]."
        mapper.only(step, {"model_name", "model_version", "input_map", "output_map"}, at)
        steps.append(
            {
                "model_name": mapper.text(step, "model_name", at) or "",
                "model_version": mapper.integer(step, "model_version", at, default=-1),
                "input_map": _map(mapper, step, "input_map", at),
                "output_map": _map(mapper, step, "output_map", at),
            }
        )
    if not steps:
        raise mapper.fail(f"{where}step", "an ensemble needs at least one step")
    return {"steps": steps}


def _map(mapper: _Mapper, msg: Message, key: str, where: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for entry in mapper.subs(msg, key, where):
        name = mapper.text(entry, "key", f"{where}{key}.")
        value = mapper.text(entry, "value", f"{where}{key}.")
        if not name or not value:
            raise mapper.fail(f"{where}{key}", "each entry needs key and value", entry)
        if name in out:
            raise mapper.fail(f"{where}{key}", f"key {name!r} is mapped twice", entry)
        out[name] = value
    return out
