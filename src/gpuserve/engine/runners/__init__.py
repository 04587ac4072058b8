"""Runners: one per loaded model version, behind one contract (:mod:`.base`).

* :mod:`.base`: :class:`~.base.VersionRunner` (submit, infer, stream, statistics, health,
  in-flight count, drain), the response streams;
* :mod:`.batching`: dynamic and sequence batching (a scheduling core and its batcher);
* :mod:`.streaming`: decoupled models (a stream of responses per request);
* :mod:`.ensemble`: a DAG of steps, each entering its model's runner;
* :mod:`.factory`: picks a version's runner at load from its config and capabilities.
"""
