"""Text helpers shared by the backends and the built-in models (neither imports the other),
below both: they import neither (the admission step built on them, which answers in the
backend contract's terms, is :mod:`gpuserve.backends.text_admission`).

* :mod:`~gpuserve.text.decode`: a BYTES tensor -> one string per row;
* :mod:`~gpuserve.text.truncation`: truncation before tokenisation (the prefix whose tokens
  are those of the whole text).
"""
