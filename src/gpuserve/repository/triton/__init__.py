"""Triton's model configuration (``config.pbtxt``) read into gpuserve's: the text format,
the configuration, ensembles and sequence batching."""
