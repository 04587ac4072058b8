"""Triton's Python backend API, so a Triton ``model.py`` runs unchanged.

:mod:`.utils` is the ``triton_python_backend_utils`` module such a file imports (it is
registered under that name in ``sys.modules`` before the file is imported, never installed as
a top-level package); :mod:`.backend` runs its ``TritonPythonModel``.
"""
