"""``python -m prefixcache``: the command line."""

from prefixcache.cli import main

main()
