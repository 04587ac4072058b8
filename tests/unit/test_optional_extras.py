"""Optional dependencies (issue 19, BC-35): a missing one is one line naming the extra that
installs it, wherever it is imported; every first import and resolution of lazily built names
is done under one lock, so parallel model loads never see a half-built module."""

from __future__ import annotations

import ast
import sys
import threading
import time
from pathlib import Path

import pytest

import gpuserve
from gpuserve.backends import optional
from gpuserve.backends.optional import (
    EXTRAS,
    MissingDependencyError,
    first_use,
    library_lock,
    missing_dependency,
    require,
)

PACKAGE = Path(gpuserve.__file__).parent

#: Files that may import an optional package directly, and why that is safe.
DIRECT_IMPORTS_ALLOWED = {
    "backends/optional.py": "the one place that imports them (importlib, under the lock)",
    "bench/report.py": "matplotlib.pyplot, right after require('matplotlib') under its lock",
    "models/text_embedding_onnx.py": "runs after gpuserve export's up-front require('onnx')",
}


@pytest.fixture()
def missing(monkeypatch):
    """Make the named top-level packages look uninstalled (``None`` in ``sys.modules``)."""
    monkeypatch.setattr(optional, "_READY", {})

    def hide(*names: str) -> None:
        for name in names:
            for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
                monkeypatch.delitem(sys.modules, loaded)
            monkeypatch.setitem(sys.modules, name, None)

    return hide


def assert_one_line(err: pytest.ExceptionInfo, text: str, extra: str) -> None:
    message = err.value.message
    assert "\n" not in message and text in message, message
    assert f"pip install 'gpuserve[{extra}]'" in message, message
    assert isinstance(err.value, MissingDependencyError) and err.value.extra == extra


def test_every_optional_import_names_its_extra(missing, tmp_path):
    from gpuserve.backends.huggingface import import_transformers
    from gpuserve.backends.onnx_backend import import_ort
    from gpuserve.bench.report import plot_unavailable, pyplot
    from gpuserve.cli.export import export_model

    missing("transformers", "onnxruntime", "onnx", "matplotlib")
    with pytest.raises(MissingDependencyError) as err:
        import_transformers()
    assert_one_line(err, "backend 'huggingface' needs transformers", "huggingface")
    with pytest.raises(MissingDependencyError) as err:
        import_ort()
    assert_one_line(err, "backend 'onnx' needs onnxruntime", "onnx")
    assert "onnxruntime-gpu" in err.value.message
    with pytest.raises(MissingDependencyError) as err:
        pyplot()
    assert_one_line(err, "the latency plot (bench.png) needs matplotlib", "bench")
    assert "gpuserve[bench]" in (plot_unavailable() or "")
    with pytest.raises(MissingDependencyError) as err:
        export_model(tmp_path, "anything")  # refused before the repository is even read
    assert_one_line(err, "exporting to ONNX needs onnx", "onnx")


def test_a_package_missing_deep_inside_a_library_is_named():
    """torch raises its own exporter error *from* the ModuleNotFoundError of onnx."""

    class ExporterError(RuntimeError):
        pass

    try:
        try:
            raise ModuleNotFoundError("No module named 'onnxscript'", name="onnxscript")
        except ModuleNotFoundError as inner:
            raise ExporterError("Module onnx is not installed!") from inner
    except ExporterError as err:
        found = missing_dependency(err, "exporting to ONNX")
    assert found is not None and found.extra == "onnx" and "onnxscript" in found.message
    assert missing_dependency(ModuleNotFoundError("x", name="numpyy"), "x") is None
    assert missing_dependency(ValueError("no"), "x") is None


def test_no_optional_package_is_imported_around_the_lock():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            for name in names:
                if name.partition(".")[0] in EXTRAS and relative not in DIRECT_IMPORTS_ALLOWED:
                    found.append(f"{relative}:{node.lineno} imports {name}")
    assert not found, "use gpuserve.backends.optional.require():\n" + "\n".join(found)


LAZY = '''
import sys, threading, time, types


class _Lazy(types.ModuleType):
    """Builds its names on first access, not atomically (as transformers' _LazyModule)."""

    _building = False

    def __getattr__(self, name):
        if name != "AutoThing":
            raise AttributeError(name)
        if type(self)._building:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        type(self)._building = True
        time.sleep(0.05)
        setattr(self, name, object())
        return getattr(self, name)


sys.modules[__name__].__class__ = _Lazy
'''


def _race(tmp_path, monkeypatch, name: str, get) -> list[BaseException]:
    (tmp_path / f"{name}.py").write_text(LAZY)
    monkeypatch.syspath_prepend(str(tmp_path))
    start = threading.Barrier(8)
    errors: list[BaseException] = []

    def one() -> None:
        start.wait()
        try:
            get()
        except BaseException as err:  # collected for the assertion
            errors.append(err)

    threads = [threading.Thread(target=one) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    return errors


def test_parallel_first_use_of_a_lazy_module_is_safe_through_require(tmp_path, monkeypatch):
    import importlib

    unsafe = _race(
        tmp_path, monkeypatch, "lazy_a", lambda: importlib.import_module("lazy_a").AutoThing
    )
    assert unsafe and all(isinstance(e, AttributeError) for e in unsafe)  # the BC-35 symptom
    safe = _race(tmp_path, monkeypatch, "lazy_b", lambda: require("lazy_b", "test", ["AutoThing"]))
    assert safe == []
    for name in ("lazy_a", "lazy_b"):
        monkeypatch.delitem(sys.modules, name)


def test_library_lock_serialises_and_first_use_only_the_first_time():
    inside = {"now": 0, "most": 0}
    guard = threading.Lock()

    def count(block) -> None:
        with block():
            with guard:
                inside["now"] += 1
                inside["most"] = max(inside["most"], inside["now"])
            time.sleep(0.02)
            with guard:
                inside["now"] -= 1

    def run_all(block) -> int:
        inside["most"] = 0
        threads = [threading.Thread(target=count, args=(block,)) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        return inside["most"]

    assert run_all(lambda: library_lock("test-serial")) == 1
    assert library_lock("test-serial") is library_lock("test-serial")
    key = object()
    with first_use("test-first", key):
        pass  # the first use, alone
    assert run_all(lambda: first_use("test-first", key)) > 1  # later ones run side by side
