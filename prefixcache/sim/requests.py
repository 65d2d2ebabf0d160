"""A workload rendered once into exactly what the cache sees, request by request (:class:`CacheRequests`).

Two modes:

* ``keys`` — a hash-id trace: request i looks up ``keys[offsets[i]:offsets[i+1]]`` (every hash id may hit,
  the partial last block included: its id names that partial block) and commits all of them.
* ``tokens`` — a text/chat/token scenario: request i looks up its prompt ids and commits the prompt plus
  the reply a model would generate, less the reply's last token (which has no KV yet in a real model). A prompt
  with images is its key stream (``prefixcache.core.key_material``): the blocks its images' placeholders touch
  carry their content ids, so the same ids behind another image miss as they do on a model.
  Replies are synthesised (seeded ASCII, ``max_new_tokens`` byte tokens) and join the history of later
  turns of a conversation, so every capacity and policy replays the very same requests.

Rendering once makes a capacity sweep cheap and gives the exact number of blocks a replay can ever insert
(the pool size of an "unlimited" capacity).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from prefixcache.core.errors import InputError
from prefixcache.core.hashing import as_token_array
from prefixcache.core.key_material import block_material, keyed_tokens
from prefixcache.workload.render import ByteRenderer, Conversations, Renderer, Span, synthetic_reply
from prefixcache.workload.scenario import Scenario
from prefixcache.workload.trace import Trace

if TYPE_CHECKING:
    from prefixcache.sim.node_trace import NodeTrace


@dataclass(frozen=True)
class CacheRequests:
    """Per-request columns (index i = request i, in replay order). See the module docstring for the modes."""

    mode: str  # "keys" | "tokens"
    block_size: int
    namespace: list[str]
    prompt_tokens: list[int]  # prompt length in tokens
    lookup_blocks: list[int]  # blocks looked up: hash ids (keys), ceil(prompt / block_size) (tokens)
    timestamp: list[float | None]  # milliseconds, None when the request has none
    output_tokens: list[int | None]
    keys: np.ndarray | None = field(default=None, repr=False)  # keys mode: every request's ids back to back
    offsets: list[int] | None = field(default=None, repr=False)
    prompts: list[np.ndarray] | None = field(default=None, repr=False)  # tokens mode: int32 prompt ids
    commits: list[np.ndarray] | None = field(default=None, repr=False)  # tokens mode: int32 ids to commit
    trace: Trace | None = field(default=None, repr=False)  # keys mode: the trace itself
    text: bool = False  # tokens mode: every prompt is text or chat rendered by the byte renderer (decodable)
    media: list[tuple[Span, ...]] | None = field(default=None, repr=False)  # tokens mode: each prompt's images
    memo: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)  # derived data, made once

    def __len__(self) -> int:
        return len(self.prompt_tokens)

    def request_keys(self, i: int) -> list[int]:
        """Request i's hash ids (keys mode), as Python ints: every request's list is made once per workload and
        kept in ``memo``, so the caller must not change it (the replay and the cluster index only read it)."""
        lists: list[list[int]] | None = self.memo.get("key_lists")
        if lists is None:
            assert self.keys is not None and self.offsets is not None
            ids, off = self.keys.tolist(), self.offsets
            lists = self.memo["key_lists"] = [ids[off[k] : off[k + 1]] for k in range(len(off) - 1)]
        return lists[i]

    def max_inserted_blocks(self) -> int:
        """The blocks a replay can ever hold: the smallest pool at which nothing is evicted (keys mode: the
        distinct blocks; tokens mode: every committed full block, an upper bound)."""
        if self.mode == "keys":
            return max(1, self.node_trace().num_nodes)
        assert self.commits is not None
        bs = self.block_size
        return max(1, sum(len(c) // bs for c in self.commits))

    def node_trace(self) -> NodeTrace:
        """Keys mode: the trace's blocks as dense tree-node ids (made once, then kept in ``memo``)."""
        nt = self.memo.get("node_trace")
        if nt is None:
            assert self.trace is not None
            from prefixcache.sim.node_trace import canonical_blocks  # late: only needed here

            nt = self.memo["node_trace"] = canonical_blocks(self.trace)
        return nt


def image_content_id(name: str) -> bytes:
    """The content id a scenario's image id stands for (equal ids: the same picture)."""
    return xxhash.xxh3_128_digest(b"prefixcache-scenario-image\x00" + name.encode("utf-8"))


def from_trace(trace: Trace) -> CacheRequests:
    """A hash-id trace as cache requests (its own order and block size). Changes nothing."""
    offsets = trace.offsets.tolist()
    return CacheRequests(
        mode="keys",
        block_size=trace.block_size,
        namespace=list(trace.namespace),
        prompt_tokens=trace.input_length.tolist(),
        lookup_blocks=np.diff(trace.offsets).tolist(),
        timestamp=trace.timestamp.tolist(),
        output_tokens=trace.output_length.tolist(),
        keys=trace.ids,
        offsets=offsets,
        trace=trace,
    )


def from_scenario(scenario: Scenario, block_size: int, renderer: Renderer | None = None) -> CacheRequests:
    """Render a scenario's requests once (see the module docstring). Raises InputError naming the file and
    line of a request whose token ids the cache cannot take (e.g. an id >= 2**31)."""
    if scenario.trace is not None:
        return from_trace(scenario.trace)
    renderer = renderer or ByteRenderer()
    conv = Conversations()
    prompts: list[np.ndarray] = []
    commits: list[np.ndarray] = []
    outputs: list[int | None] = []
    media: list[tuple[Span, ...]] = []
    for i, req in enumerate(scenario.requests):
        k = req.max_new_tokens or scenario.max_new_tokens
        reply = synthetic_reply(scenario.seed, i, k)
        try:
            prompt, spans = conv.prompt_spans(req, renderer)
            arr = as_token_array(prompt, f"request {i + 1} tokens")
        except (TypeError, ValueError) as exc:
            raise InputError(str(exc), scenario.path, req.line) from None
        commit = np.concatenate([arr, np.frombuffer(reply.encode("ascii"), np.uint8)[:-1].astype(np.int32)])
        if spans:  # each image's content in the key stream of the blocks it touches (as the model side keys it)
            try:
                material = block_material([(a, b, image_content_id(name)) for a, b, name in spans], block_size)
                arr, commit = keyed_tokens(arr, material, block_size), keyed_tokens(commit, material, block_size)
            except ValueError as exc:
                raise InputError(f"request {i + 1}: {exc}", scenario.path, req.line) from None
        if len(arr) == 0:
            raise InputError(f"request {i + 1} renders to an empty prompt", scenario.path, req.line)
        prompts.append(arr)
        commits.append(commit)
        media.append(tuple(spans))
        outputs.append(k)
        conv.add_reply(req, reply)
    return CacheRequests(
        mode="tokens",
        block_size=block_size,
        namespace=[r.namespace for r in scenario.requests],
        prompt_tokens=[len(p) for p in prompts],
        lookup_blocks=[-(-len(p) // block_size) for p in prompts],
        timestamp=[r.timestamp for r in scenario.requests],
        output_tokens=outputs,
        prompts=prompts,
        commits=commits,
        text=all(r.tokens is None for r in scenario.requests) and isinstance(renderer, ByteRenderer),
        media=media if any(media) else None,
    )
