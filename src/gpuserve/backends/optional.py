"""Optional dependencies: imported once, under a lock, with one line naming the extra to install.

Several model versions load at the same time, each on its own executor thread (BC-35), and
libraries such as ``transformers`` build their top-level names lazily on first attribute
access: two threads importing it at once could see a half-initialised module (``module
'transformers' has no attribute 'AutoTokenizer'``). Every optional import therefore goes
through :func:`require`, which imports the module and resolves the attributes a caller needs
while holding one process-wide lock, so a module is only ever handed out complete.

:func:`library_lock` gives the lock that serialises a library's initialisation calls that are
not safe to run concurrently (``transformers``' ``from_pretrained``, ``torch.compile``), and
:func:`first_use` one that is unsafe only the first time (ONNX Runtime's first session); see
the backends for what each one serialises.

A missing package raises :class:`MissingDependencyError`, whose message is one line::

    backend 'onnx' needs onnxruntime, which is not installed: pip install 'gpuserve[onnx]'
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from collections.abc import Hashable, Iterator, Sequence
from types import ModuleType

from gpuserve.errors import ConfigError

#: Import name -> (pip package, gpuserve extra that installs it).
EXTRAS: dict[str, tuple[str, str]] = {
    "onnx": ("onnx", "onnx"),
    "onnxruntime": ("onnxruntime", "onnx"),
    "onnxscript": ("onnxscript", "onnx"),
    "transformers": ("transformers", "huggingface"),
    "matplotlib": ("matplotlib", "bench"),
    "opentelemetry": ("opentelemetry-sdk", "tracing"),
}

# One re-entrant lock for every first import: importing one optional package may import
# another (onnxscript imports onnx), and the imports are rare (at model load), so one lock
# costs nothing and cannot deadlock against itself.
_IMPORT_LOCK = threading.RLock()
_LIBRARY_LOCKS: dict[str, threading.RLock] = {}
_READY: dict[tuple[str, tuple[str, ...]], ModuleType] = {}
_USED: set[tuple[str, Hashable]] = set()


class MissingDependencyError(ConfigError):
    """An optional package is not installed; the message names the extra that installs it.

    Attributes:
        module: The import name that is missing (``onnxruntime``).
        extra: The gpuserve extra that installs it (``onnx``), or None when none does.
    """

    def __init__(self, message: str, module: str, extra: str | None) -> None:
        super().__init__(message)
        self.module = module
        self.extra = extra


def install_hint(module: str) -> str:
    """``pip install 'gpuserve[EXTRA]'`` for an optional import name, else ``pip install X``."""
    top = module.partition(".")[0]
    package, extra = EXTRAS.get(top, (top, ""))
    if extra:
        return f"pip install 'gpuserve[{extra}]'"
    return f"pip install {package}"


def missing_message(module: str, needed_for: str) -> str:
    """The one-line message for a missing optional import: what needs it, how to install it."""
    top = module.partition(".")[0]
    package = EXTRAS.get(top, (top, ""))[0].partition("[")[0]
    return f"{needed_for} needs {package}, which is not installed: {install_hint(top)}"


def missing_dependency(err: BaseException, needed_for: str) -> MissingDependencyError | None:
    """A :class:`MissingDependencyError` when ``err``, or an exception it was raised from, is
    a known optional package that is not installed (also when a library such as torch
    imported it deep inside and raised its own error), else None."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        name = getattr(current, "name", None)
        if isinstance(current, ModuleNotFoundError) and name:
            top = name.partition(".")[0]
            if top in EXTRAS:
                return MissingDependencyError(
                    missing_message(top, needed_for), top, EXTRAS[top][1] or None
                )
        current = current.__cause__ or current.__context__
    return None


def require(module: str, needed_for: str, attributes: Sequence[str] = ()) -> ModuleType:
    """Import ``module`` (and resolve ``attributes`` on it) under the import lock.

    Args:
        module: Import name, e.g. ``onnxruntime`` or ``transformers``.
        needed_for: What needs it, for the message (``backend 'onnx'``, ``gpuserve export``).
        attributes: Names the caller uses, possibly dotted (``utils.logging``); resolving them
            here means a lazily built module is complete before any thread sees it.

    Returns:
        The module.

    Raises:
        MissingDependencyError: the package (or one it needs) is not installed.
        ConfigError: the package is installed but fails to import (the message says why).
    """
    key = (module, tuple(attributes))
    ready = _READY.get(key)
    if ready is not None:
        return ready
    with _IMPORT_LOCK:
        ready = _READY.get(key)
        if ready is not None:
            return ready
        try:
            loaded = importlib.import_module(module)
            for dotted in attributes:
                value: object = loaded
                for part in dotted.split("."):
                    value = getattr(value, part)
        except ImportError as err:
            missing = missing_dependency(err, needed_for)
            if missing is not None:
                raise missing from None
            raise ConfigError(
                f"{needed_for} needs {module}, which failed to import: "
                f"{type(err).__name__}: {err} ({install_hint(module)} installs a working copy)"
            ) from None
        except AttributeError as err:
            raise ConfigError(
                f"{needed_for} needs {module} with {err.name or 'an attribute it lacks'}: "
                f"{err}; the installed version may be too old or too new "
                f"({install_hint(module)} installs a supported one)"
            ) from None
        _READY[key] = loaded
        return loaded


def import_lock() -> threading.RLock:
    """The lock held while an optional package is first imported; code that executes other
    modules at load time (``model.py`` files) holds it too, so their imports never race."""
    return _IMPORT_LOCK


def library_lock(library: str) -> threading.RLock:
    """The lock that serialises ``library``'s initialisation calls that are not thread-safe
    (one re-entrant lock per library name, created on first use)."""
    with _IMPORT_LOCK:
        lock = _LIBRARY_LOCKS.get(library)
        if lock is None:
            lock = _LIBRARY_LOCKS[library] = threading.RLock()
        return lock


@contextlib.contextmanager
def first_use(library: str, key: Hashable = None) -> Iterator[None]:
    """Run the block alone (under :func:`library_lock`) until it has once succeeded for
    ``(library, key)``; later blocks run concurrently.

    For initialisation a library does once per process, on the first call (loading provider
    libraries, building global registries), whose later calls are thread-safe.
    """
    if (library, key) in _USED:
        yield
        return
    with library_lock(library):
        if (library, key) in _USED:
            yield
            return
        yield
        _USED.add((library, key))
