"""A model version's lifecycle: the reconcile planner (pure), its executor, loading and
health, ensembles' loading, rollback/canary routing, load retries, devices, trial loads."""
