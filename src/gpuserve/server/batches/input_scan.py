"""The files of a batch job as plain file operations: one pass over an input file that
validates it (:func:`scan_input`), and an output file reopened at its committed length
(:func:`open_at`: what a killed server wrote past it is cut off)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from gpuserve.server.batches.wire import BadLine, parse_line, read_lines


@dataclass(slots=True)
class InputScan:
    """What validation found in an input file."""

    total: int
    bad: list[BadLine]
    repeated: list[dict[str, object]]
    model: str | None


def scan_input(path: Path, endpoint: str) -> InputScan:
    """Read an input file once (worker thread): its lines, malformed lines and repeated
    ``custom_id`` s (the first few)."""
    total = 0
    bad: list[BadLine] = []
    seen: dict[str, int] = {}
    repeated: list[dict[str, object]] = []
    model = None
    with path.open("rb") as stream:
        for number, raw in read_lines(stream):
            total += 1
            line = parse_line(raw, number, endpoint)
            if isinstance(line, BadLine):
                bad.append(line)
                continue
            first = seen.setdefault(line.custom_id, number)
            if first != number and len(repeated) < 10:
                repeated.append(
                    {
                        "code": "duplicate_custom_id",
                        "message": f"line {number} repeats the custom_id {line.custom_id!r} "
                        f"of line {first}: each custom_id must be unique",
                        "line": number,
                    }
                )
            if model is None and type(line.body.get("model")) is str:
                model = line.body["model"]
    return InputScan(total, bad, repeated, model)


def open_at(path: Path, length: int) -> int:
    """Open ``path`` for writing (created when missing) and cut it to ``length`` bytes."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, length)
    return fd


__all__ = ["InputScan", "open_at", "scan_input"]
