"""Ensembles: the step DAG and one request's run through it (``plan``), the device hand-off
between steps (``handoff``), and per-step statistics (``stats``)."""
