"""Text helpers shared by the backends and the built-in models (neither imports the other):

* :mod:`~gpuserve.text.decode`: a BYTES tensor -> one string per row;
* :mod:`~gpuserve.text.truncation`: truncation before tokenisation (the prefix whose tokens
  are those of the whole text) and the admission step that applies it.
"""
