"""Triton's ``sequence_batching`` (``config.pbtxt``) mapped onto gpuserve's
:class:`~gpuserve.config.sequence.SequenceBatchingConfig` fields.

Served as Triton means it: ``max_sequence_idle_microseconds``, ``direct``
(``max_queue_delay_microseconds``, ``minimum_slot_utilization``), ``oldest``
(``max_candidate_sequences``, ``preferred_batch_size``, ``max_queue_delay_microseconds``),
``control_input`` (one control per input: ``CONTROL_SEQUENCE_START`` / ``_END`` / ``_READY``
with ``int32_false_true``, ``fp32_false_true`` or ``bool_false_true``, and
``CONTROL_SEQUENCE_CORRID`` with ``data_type``) and ``state`` (``input_name``, ``output_name``,
``data_type``, ``dims``, an ``initial_state`` of ``zero_data``). Anything else is refused
with the field named (``iterative_sequence``, ``initial_state.data_file``, ...).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpuserve.repository.triton.pbtxt import Message
    from gpuserve.repository.triton.config import _Mapper

_KINDS = {
    "CONTROL_SEQUENCE_START": "start",
    "CONTROL_SEQUENCE_END": "end",
    "CONTROL_SEQUENCE_READY": "ready",
    "CONTROL_SEQUENCE_CORRID": "corrid",
}
_FLAGS = {"int32_false_true": "INT32", "fp32_false_true": "FP32", "bool_false_true": "BOOL"}


def sequence_batching(m: _Mapper, msg: Message) -> dict[str, Any]:
    """The ``sequence_batching`` fields of ``config.yaml`` for Triton's message ``msg``.

    Raises:
        ConfigError: a field gpuserve does not serve, or a malformed value (file and field
            named).
    """
    where = "sequence_batching."
    m.only(
        msg,
        {"max_sequence_idle_microseconds", "control_input", "direct", "oldest", "state"},
        where,
    )
    out: dict[str, Any] = {}
    idle = m.integer(msg, "max_sequence_idle_microseconds", where)
    if idle:  # Triton's 0 means its default (1 s), as gpuserve's default
        out["max_sequence_idle_us"] = idle
    direct = m.sub(msg, "direct", where)
    oldest = m.sub(msg, "oldest", where)
    if direct is not None and oldest is not None:
        raise m.fail(f"{where}oldest", "set one strategy, direct or oldest, not both")
    if direct is not None:
        out["direct"] = _direct(m, direct, f"{where}direct.")
    if oldest is not None:
        out["oldest"] = _oldest(m, oldest, f"{where}oldest.")
    out["control_inputs"] = [
        _control(m, c, f"{where}control_input[{i}].")
        for i, c in enumerate(m.subs(msg, "control_input", where))
    ]
    out["states"] = [
        _state(m, s, f"{where}state[{i}].") for i, s in enumerate(m.subs(msg, "state", where))
    ]
    return out


def _direct(m: _Mapper, msg: Message, where: str) -> dict[str, Any]:
    m.only(msg, {"max_queue_delay_microseconds", "minimum_slot_utilization"}, where)
    out: dict[str, Any] = {
        "max_queue_delay_us": m.integer(msg, "max_queue_delay_microseconds", where)
    }
    share = _number(m, msg, "minimum_slot_utilization", where)
    if share is not None:
        out["minimum_slot_utilization"] = share
    return out


def _oldest(m: _Mapper, msg: Message, where: str) -> dict[str, Any]:
    m.only(
        msg,
        {
            "max_candidate_sequences",
            "preferred_batch_size",
            "max_queue_delay_microseconds",
            "preserve_ordering",
        },
        where,
    )
    candidates = m.integer(msg, "max_candidate_sequences", where)
    if candidates < 1:
        raise m.fail(
            f"{where}max_candidate_sequences",
            "must be a positive integer (Triton's too)",
            candidates,
        )
    return {
        "max_candidate_sequences": candidates,
        "preferred_batch_sizes": m.ints(msg, "preferred_batch_size", where),
        "max_queue_delay_us": m.integer(msg, "max_queue_delay_microseconds", where),
    }


def _control(m: _Mapper, msg: Message, where: str) -> dict[str, Any]:
    m.only(msg, {"name", "control"}, where)
    name = m.text(msg, "name", where) or ""
    controls = m.subs(msg, "control", where)
    if len(controls) != 1:
        raise m.fail(
            f"{where}control", "expected exactly one control per control_input", len(controls)
        )
    control = controls[0]
    inner = f"{where}control[0]."
    m.only(control, {"kind", *_FLAGS, "data_type"}, inner)
    kind = m.text(control, "kind", inner)
    if kind not in _KINDS:
        raise m.fail(f"{inner}kind", f"expected one of {', '.join(_KINDS)}", kind)
    out: dict[str, Any] = {"name": name, "kind": _KINDS[kind]}
    flags = [key for key in _FLAGS if key in control]
    if _KINDS[kind] == "corrid":
        if flags:
            raise m.fail(f"{inner}{flags[0]}", "CONTROL_SEQUENCE_CORRID takes data_type only")
        out["datatype"] = m.datatype(control, inner)
        return out
    if "data_type" in control:
        raise m.fail(f"{inner}data_type", f"{kind} takes one of {', '.join(_FLAGS)}")
    if len(flags) != 1:
        raise m.fail(inner.rstrip("."), f"{kind} needs exactly one of {', '.join(_FLAGS)}", flags)
    key = flags[0]
    values = control[key]
    numbers = [float(v) for v in values if isinstance(v, (int, float))]
    if len(numbers) != 2 or len(values) != 2:
        raise m.fail(f"{inner}{key}", "expected two values [false, true]", values)
    out["datatype"] = _FLAGS[key]
    out["false_true"] = numbers
    return out


def _state(m: _Mapper, msg: Message, where: str) -> dict[str, Any]:
    m.only(
        msg,
        {
            "input_name",
            "output_name",
            "data_type",
            "dims",
            "initial_state",
            "use_same_buffer_for_input_output",
            "use_growable_memory",
        },
        where,
    )
    for key in ("use_same_buffer_for_input_output", "use_growable_memory"):
        if m.flag(msg, key, where):
            raise m.fail(f"{where}{key}", "not supported by gpuserve (host-side state)", True)
    out: dict[str, Any] = {
        "input_name": m.text(msg, "input_name", where) or "",
        "output_name": m.text(msg, "output_name", where) or "",
        "datatype": m.datatype(msg, where),
        "shape": m.ints(msg, "dims", where),
    }
    initials = m.subs(msg, "initial_state", where)
    if len(initials) > 1:
        raise m.fail(f"{where}initial_state", "gpuserve takes one initial state", len(initials))
    if initials:
        inner = f"{where}initial_state."
        initial = initials[0]
        m.only(
            initial,
            {"data_type", "dims", "zero_data", "name"},
            inner,
            "not supported by gpuserve (only zero_data initial states)",
        )
        if not m.flag(initial, "zero_data", inner):
            raise m.fail(f"{inner}zero_data", "gpuserve starts states from zeros: set it true")
        if "dims" in initial:
            out["initial_shape"] = m.ints(initial, "dims", inner)
    return out


def _number(m: _Mapper, msg: Message, key: str, where: str) -> float | None:
    value = m.one(msg, key, where)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise m.fail(f"{where}{key}", "expected a number", value)
    return float(value)
