"""User model files import like ordinary modules (dataclasses with postponed annotations
need the module registered by name)."""

from __future__ import annotations

from gpuserve.backends.loader import import_module_from_path

SOURCE = """
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Box:
    width: int


VALUE = Box(3).width
"""


def test_dataclass_with_postponed_annotations_imports(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(SOURCE)
    module = import_module_from_path(path, "boxes", 1)
    assert module.VALUE == 3
    # a second load (a reload of the version) gets a fresh module
    assert import_module_from_path(path, "boxes", 1) is not module
