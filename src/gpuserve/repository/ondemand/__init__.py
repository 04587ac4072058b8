"""Many models per device: load on demand, residency limits and eviction, what a model holds
in memory (estimated before load, measured after) and the failure record."""
