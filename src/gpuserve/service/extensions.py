"""Triton's optional extensions as the inference service offers them: client shared memory,
classification, and the server metadata that lists what is on.

* Shared memory is off unless ``allow_client_shm`` is set; then :attr:`Extensions.shared_memory`
  is the server's one registry of system shared-memory regions (both front ends use it, so a
  region registered over HTTP serves gRPC requests too) and :attr:`Extensions.cuda_shared_memory`
  holds the CUDA regions (opened over CUDA IPC where torch sees a GPU; registration refused
  clearly on a CPU-only server).
* :attr:`Extensions.traces` and :attr:`Extensions.logs`: Triton's trace and log settings
  (see :mod:`gpuserve.service.tracing.runtime_settings`).
* :meth:`Extensions.classify` turns the outputs a request asked ``classification: k`` of into
  their top-k classes, with labels from the output's ``label_filename`` (a file in the model
  folder).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from gpuserve.config import ModelConfig, ServerConfig
from gpuserve.engine.request import InferenceResponse
from gpuserve.errors import ConfigError, InvalidInputError, PermissionDeniedError
from gpuserve.repository.manager import ModelManager
from gpuserve.service.apis.classification import LabelFiles, classify
from gpuserve.service.constants import EXTENSIONS
from gpuserve.service.tracing.runtime_settings import LogSettings, TraceSettings
from gpuserve.service.memory.shared_memory import CudaSharedMemoryRegistry, SharedMemoryRegistry
from gpuserve.service.tracing.trace_config import parse_trace_config
from gpuserve.service.views import ServerMetadata, Views

#: Extensions every server has beyond :data:`~gpuserve.service.constants.EXTENSIONS`.
ALWAYS = ("classification", "trace", "logging")
#: Listed only when client shared memory is allowed.
SHARED_MEMORY = ("system_shared_memory",)

#: What a client is told when it calls the shared-memory API of a server without it.
SHM_DISABLED = (  # Triton's words first (its tests look for them)
    "Client shared memory is disabled. Start the server with --allow-client-shm "
    "(GPUSERVE_ALLOW_CLIENT_SHM=1) to enable."
)


def server_extensions(config: ServerConfig) -> list[str]:
    """The extension names server metadata lists for ``config``."""
    names = [*EXTENSIONS, *ALWAYS]
    if config.allow_client_shm:
        names.extend(SHARED_MEMORY)
    return names


class ExtensionViews(Views):
    """:class:`Views` whose server metadata lists the extensions ``config`` enables."""

    def __init__(self, manager: ModelManager, config: ServerConfig) -> None:
        super().__init__(manager)
        self.extensions = server_extensions(config)

    def server_metadata(self) -> ServerMetadata:
        """The server's name, release and the extensions on."""
        return replace(super().server_metadata(), extensions=list(self.extensions))


class Extensions:
    """The extension state of one server.

    Args:
        manager: The model manager (model folders, for label files).
        config: Server settings (``allow_client_shm``).

    Attributes:
        shared_memory: The system shared-memory regions, or None when not allowed.
        cuda_shared_memory: The CUDA shared-memory API, or None when not allowed.
    """

    def __init__(self, manager: ModelManager, config: ServerConfig) -> None:
        self.manager = manager
        allowed = config.allow_client_shm
        # one namespace for both kinds, as in Triton; the codecs reach CUDA regions through
        # the system registry's view()
        self.cuda_shared_memory = CudaSharedMemoryRegistry() if allowed else None
        self.shared_memory = SharedMemoryRegistry(cuda=self.cuda_shared_memory) if allowed else None
        self.labels = LabelFiles()
        self.traces = _trace_settings(config)
        self.logs = LogSettings()

    def check_model(self, name: str) -> None:
        """Raises ModelNotFoundError (404) when the repository has no model ``name``."""
        self.manager.model(name)

    def system_registry(self) -> SharedMemoryRegistry:
        """The system shared-memory registry.

        Raises:
            PermissionDeniedError: client shared memory is not allowed (403).
        """
        if self.shared_memory is None:
            raise PermissionDeniedError(SHM_DISABLED)
        return self.shared_memory

    def cuda_registry(self) -> CudaSharedMemoryRegistry:
        """The CUDA shared-memory API.

        Raises:
            PermissionDeniedError: client shared memory is not allowed (403).
        """
        if self.cuda_shared_memory is None:
            raise PermissionDeniedError(SHM_DISABLED)
        return self.cuda_shared_memory

    def classify(
        self,
        model: str,
        config: ModelConfig,
        response: InferenceResponse,
        counts: Mapping[str, int],
    ) -> InferenceResponse:
        """``response`` with the outputs in ``counts`` answered as their top-k classes (see
        :func:`gpuserve.service.apis.classification.classify`).

        Args:
            model: The model (its folder holds the label files).
            config: The configuration of the version that answered.
            response: The engine's answer.
            counts: Output name -> ``k``.

        Raises:
            InvalidInputError: a label file that cannot be read, too many classes.
        """
        files = {spec.name: spec.label_filename for spec in config.outputs}

        def labels_of(name: str) -> tuple[str, ...] | None:
            filename = files.get(name)
            if not filename:
                return None
            folder = self.manager.model(model).path
            if folder is None:
                raise InvalidInputError(
                    f"output {name!r}: model {model!r} has no folder to read {filename!r} from"
                )
            return self.labels.labels(folder, filename)

        return classify(response, counts, config, labels_of)

    def close(self) -> None:
        """Unregister every region and close the trace files (server shutdown)."""
        if self.shared_memory is not None:
            self.shared_memory.close()
        self.traces.close()


def _trace_settings(config: ServerConfig) -> TraceSettings:
    """The tracer ``--trace-config`` asks for.

    Raises:
        ConfigError: a bad entry (the message quotes it); MissingDependencyError for
            ``mode=opentelemetry`` without the ``tracing`` extra.
    """
    start = parse_trace_config(config.trace_config)
    try:
        return TraceSettings(
            config.trace_dir, mode=start.mode, otel=start.otel, initial=start.settings
        )
    except InvalidInputError as err:
        raise ConfigError(f"--trace-config: {err.message}") from None
