"""Simulation and planning: the one replay loop, the one-pass LRU curve, the optimal bound, capacity plans and
KV-size arithmetic. Imports prefixcache.core and prefixcache.workload."""
