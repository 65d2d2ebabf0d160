"""engine: the model side of prefixcache (torch + transformers)."""
