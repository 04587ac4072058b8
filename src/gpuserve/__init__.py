"""gpuserve: a GPU inference server speaking the KServe V2 Open Inference Protocol."""

from gpuserve.backends.base import LoadContext, RowErrors
from gpuserve.backends.python import PythonModel

__version__ = "0.1.0"
__all__ = ["LoadContext", "PythonModel", "RowErrors", "__version__"]
