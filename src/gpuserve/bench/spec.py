"""Parsing of load specifications given on the command line.

``--concurrency`` and ``--request-rate`` take either a list (``1,2,8``) or a range
``START:END:STEP`` where STEP is ``xF`` (multiply by F, geometric) or ``+N`` / ``N`` (add N,
linear). The end is always included, so ``1:64:x2`` is 1, 2, 4, ..., 64 and ``1:48:x2`` ends
with 48.
"""

from __future__ import annotations


def parse_levels(text: str, *, integer: bool = True) -> list[float]:
    """Load levels from ``text``, ascending and without duplicates.

    Args:
        text: ``"8"``, ``"1,2,8"``, ``"1:64:x2"`` or ``"100:400:+100"``.
        integer: Levels must be whole numbers (concurrency) rather than rates.

    Raises:
        ValueError: a malformed spec, a level <= 0, or a step that does not grow.
    """
    text = text.strip()
    if not text:
        raise ValueError("empty load spec")
    if ":" in text:
        levels = _parse_range(text)
    else:
        levels = [float(part) for part in text.split(",") if part.strip()]
    if integer:
        for level in levels:
            if level != int(level):
                raise ValueError(f"{text!r}: concurrency levels must be whole numbers, got {level}")
        levels = [float(int(level)) for level in levels]
    for level in levels:
        if level <= 0:
            raise ValueError(f"{text!r}: every level must be > 0, got {level:g}")
    return sorted(set(levels))


def _parse_range(text: str) -> list[float]:
    parts = text.split(":")
    if len(parts) not in (2, 3):
        raise ValueError(f"{text!r}: expected START:END[:STEP] (STEP like x2 or +4)")
    start, end = float(parts[0]), float(parts[1])
    step = parts[2].strip() if len(parts) == 3 else "x2"
    if end < start:
        raise ValueError(f"{text!r}: END {end:g} is below START {start:g}")
    levels: list[float] = []
    value = start
    if step.startswith("x"):
        factor = float(step[1:])
        if factor <= 1:
            raise ValueError(f"{text!r}: a multiplying step must be > 1, got {step}")
        if start <= 0:
            raise ValueError(f"{text!r}: a geometric range needs START > 0")
        while value < end - 1e-9:
            levels.append(value)
            value *= factor
    else:
        increment = float(step.removeprefix("+"))
        if increment <= 0:
            raise ValueError(f"{text!r}: an adding step must be > 0, got {step}")
        while value < end - 1e-9:
            levels.append(value)
            value += increment
    levels.append(end)
    return levels


def parse_shapes(items: list[str]) -> dict[str, list[int]]:
    """``["TEXT:1", "IDS:1,128"]`` -> ``{"TEXT": [1], "IDS": [1, 128]}`` (non-batch dims).

    Raises:
        ValueError: an item without ``NAME:dims`` or with a dim that is not a positive int.
    """
    shapes: dict[str, list[int]] = {}
    for item in items:
        name, sep, dims = item.partition(":")
        if not sep or not name:
            raise ValueError(f"--shape {item!r}: expected NAME:d1,d2,...")
        try:
            values = [int(d) for d in dims.split(",") if d.strip()]
        except ValueError:
            raise ValueError(f"--shape {item!r}: dims must be integers") from None
        if any(v < 0 for v in values):
            raise ValueError(f"--shape {item!r}: dims must be >= 0")
        shapes[name] = values
    return shapes


def parse_cpus(text: str) -> set[int]:
    """A CPU list as taskset writes it: ``"0"``, ``"0,2"``, ``"2-7"``.

    Raises:
        ValueError: malformed list.
    """
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        low, sep, high = part.partition("-")
        if sep:
            cpus.update(range(int(low), int(high) + 1))
        else:
            cpus.add(int(low))
    if not cpus:
        raise ValueError(f"{text!r}: no CPUs")
    return cpus
