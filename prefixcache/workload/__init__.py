"""Workloads: hash-id traces (Mooncake, kv-cache-tester), scenario YAML, generators, prompt rendering.

Imports prefixcache.core at most."""
