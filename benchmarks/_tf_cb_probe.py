"""`transformers serve` with one probe: every prefix lookup of continuous batching's paged cache prints
``CB_PREFIX prompt=<tokens> matched=<tokens> sharing=<on|off>`` to stdout (its usage carries no cached_tokens, and
its own logger, "ContinuousBatchingLogger", is not the one --log-level sets). Arguments: those of
`transformers serve`. Used by benchmarks/serve_peers.py's `tfcbprobe` server; a diagnostic, not for timing. (From
the team's harness outside the repository, its tf_cb_probe.py, moved here with serve_peers.py.)"""

import sys

from transformers.generation.continuous_batching import cache as cb_cache
from transformers.generation.continuous_batching import scheduler as cb_scheduler

_search = cb_cache.PagedAttentionCache.search_prefix_match
_infer = cb_scheduler.Scheduler._infer_request_tokens


def search_prefix_match(self, request_id, prompt_ids):
    matched = _search(self, request_id, prompt_ids)
    print(f"CB_PREFIX prompt={len(prompt_ids)} matched={matched} sharing=on", flush=True)
    return matched


def infer_request_tokens(self, state, *args, **kwargs):
    if not self.cache.use_prefix_sharing and state.status.name == "PENDING":
        print(f"CB_PREFIX prompt={len(state.remaining_prefill_tokens)} matched=0 sharing=off", flush=True)
    return _infer(self, state, *args, **kwargs)


cb_cache.PagedAttentionCache.search_prefix_match = search_prefix_match
cb_scheduler.Scheduler._infer_request_tokens = infer_request_tokens

if __name__ == "__main__":
    from transformers.cli.transformers import main

    sys.argv = ["transformers", *sys.argv[1:]]
    sys.exit(main())
