"""Scenario and trace records and their loaders.

Two kinds of workload feed ``simulate`` and ``replay``:

* a **trace** of Mooncake-style lines ``{"timestamp", "input_length", "output_length", "hash_ids"}`` (plain
  or ``.gz`` JSONL; kv-cache-tester lines add ``session``, ``trace_id``, ``agent``, ``block_size``).
  ``load_trace(path)`` returns a :class:`Trace`: a read-only sequence of :class:`TraceRequest`, stored
  column-wise (one flat int64 array of all hash ids) so a 94M-reference trace fits in memory.
* a **scenario** (YAML, see scenarios/README.md): requests as text, chat messages, raw token ids, a seeded
  generator, or a pointer to a trace. ``load_scenario(path)`` returns a :class:`Scenario`.

Every problem with user input raises :class:`InputError`, whose message names the file, the line and the key.
"""

from __future__ import annotations

import gzip
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence, overload

import numpy as np
import yaml

DEFAULT_NAMESPACE = "default"
MOONCAKE_BLOCK_SIZE = 512  # the Mooncake traces' block size; lines may override it with "block_size"
TRACE_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".gz")
_TRACE_KEYS = {"timestamp", "input_length", "output_length", "hash_ids", "session", "trace_id", "agent", "block_size"}


class InputError(ValueError):
    """Bad user input (file, YAML, JSON line, option). The message names where: ``file:line: what``."""

    def __init__(self, message: str, path: str | Path | None = None, line: int | None = None) -> None:
        where = ""
        if path is not None:
            where = f"{path}:{line}: " if line is not None else f"{path}: "
        super().__init__(where + message)
        self.message, self.path, self.line = message, path, line


# ---- traces ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TraceRequest:
    """One line of a hash-id trace. ``hash_ids[i]`` names block i together with everything before it."""

    hash_ids: tuple[int, ...]
    input_length: int
    output_length: int = 0
    timestamp: float = 0.0  # milliseconds
    namespace: str = DEFAULT_NAMESPACE  # the kv-tester "session", else "default"
    line: int = 0  # 1-based line in the file (0 when built in code)


class Trace(Sequence[TraceRequest]):
    """A loaded hash-id trace: a read-only sequence of TraceRequest, stored column-wise.

    ``ids`` is every request's hash ids back to back (int64) and ``offsets[i]:offsets[i+1]`` selects request
    i's; ``hash_ids(i)`` is that view. Bulk users (curves, benchmarks) should read the arrays directly.
    """

    def __init__(self, path: str, block_size: int, ids: np.ndarray, offsets: np.ndarray, input_length: np.ndarray,
                 output_length: np.ndarray, timestamp: np.ndarray, namespace: list[str], lines: np.ndarray) -> None:
        self.path, self.block_size = path, block_size
        self.ids, self.offsets = ids, offsets
        self.input_length, self.output_length, self.timestamp = input_length, output_length, timestamp
        self.namespace, self.lines = namespace, lines

    def __len__(self) -> int:
        return len(self.input_length)

    @overload
    def __getitem__(self, i: int) -> TraceRequest: ...
    @overload
    def __getitem__(self, i: slice) -> "Trace": ...
    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return self.take(np.arange(len(self))[i])
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"request {i} out of range (trace has {len(self)})")
        return TraceRequest(tuple(self.hash_ids(i).tolist()), int(self.input_length[i]), int(self.output_length[i]),
                            float(self.timestamp[i]), self.namespace[i], int(self.lines[i]))

    def __iter__(self) -> Iterator[TraceRequest]:
        for i in range(len(self)):
            yield self[i]

    def hash_ids(self, i: int) -> np.ndarray:
        """Request i's hash ids (a view into ``ids``)."""
        return self.ids[self.offsets[i] : self.offsets[i + 1]]

    @property
    def num_blocks(self) -> int:
        """Block references in the whole trace."""
        return int(self.offsets[-1])

    def unique_blocks(self) -> int:
        """Distinct (namespace, hash id) pairs: the pool size at which nothing is ever evicted."""
        if len(set(self.namespace)) <= 1:
            return int(np.unique(self.ids).size)
        groups: dict[str, list[int]] = {}
        for i, ns in enumerate(self.namespace):
            groups.setdefault(ns, []).append(i)
        return sum(int(np.unique(np.concatenate([self.hash_ids(i) for i in idx])).size) for idx in groups.values())

    def take(self, index: np.ndarray) -> "Trace":
        """A new trace holding requests ``index`` (in that order)."""
        index = np.asarray(index, dtype=np.int64)
        lens = np.diff(self.offsets)[index]
        offsets = np.zeros(len(index) + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        ids = np.concatenate([self.hash_ids(int(i)) for i in index]) if len(index) else np.zeros(0, np.int64)
        return Trace(self.path, self.block_size, ids, offsets, self.input_length[index], self.output_length[index],
                     self.timestamp[index], [self.namespace[int(i)] for i in index], self.lines[index])

    def by_timestamp(self) -> "Trace":
        """Requests stably sorted by timestamp (e.g. kv-tester sessions interleaved)."""
        return self.take(np.argsort(self.timestamp, kind="stable"))


def is_trace_path(path: str | Path) -> bool:
    """True when the file name says JSONL hash-id trace (``.jsonl``, ``.jsonl.gz``, ...)."""
    name = str(path).lower()
    return name.endswith(TRACE_SUFFIXES)


def _open_text(path: Path):
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _int_field(d: dict, key: str, path: Path, line: int, *, required: bool, minimum: int = 0) -> int:
    if key not in d:
        if required:
            raise InputError(f"missing field {key!r}", path, line)
        return 0
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise InputError(f"{key} must be an integer >= {minimum}, got {v!r}", path, line)
    return v


def load_trace(path: str | Path, block_size: int | None = None) -> Trace:
    """Read a Mooncake-style JSONL trace (plain or .gz). Changes nothing.

    ``block_size``: tokens per hash id; default: each line's ``block_size`` field, else 512 (Mooncake).
    Checks every line: valid JSON object, known keys only, ``len(hash_ids) == ceil(input_length / block_size)``
    (Mooncake: the last, partial block has an id) or ``floor(...)`` (kv-cache-tester lists full blocks only).
    Raises InputError naming the file and line.
    """
    path = Path(path)
    if not path.is_file():
        raise InputError("no such trace file", path)
    if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0):
        raise InputError(f"block size must be a positive integer, got {block_size!r}", path)
    chunks: list[np.ndarray] = []
    lens: list[int] = []
    input_length: list[int] = []
    output_length: list[int] = []
    timestamp: list[float] = []
    namespace: list[str] = []
    lines: list[int] = []
    bs_seen: int | None = None
    loads = json.loads
    try:
        with _open_text(path) as f:
            for lineno, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                try:
                    d = loads(raw)
                except json.JSONDecodeError as exc:
                    raise InputError(f"not valid JSON ({exc.msg}, column {exc.colno})", path, lineno) from None
                if not isinstance(d, dict):
                    raise InputError(f"expected a JSON object, got {type(d).__name__}", path, lineno)
                if not d.keys() <= _TRACE_KEYS:
                    bad = sorted(d.keys() - _TRACE_KEYS)[0]
                    raise InputError(f"unknown key {bad!r}; known: {', '.join(sorted(_TRACE_KEYS))}", path, lineno)
                ids = d.get("hash_ids")
                if not isinstance(ids, list) or not ids:
                    raise InputError("hash_ids must be a non-empty list of integers", path, lineno)
                n_in = _int_field(d, "input_length", path, lineno, required=True, minimum=1)
                bs = d.get("block_size", block_size or MOONCAKE_BLOCK_SIZE)
                if isinstance(bs, bool) or not isinstance(bs, int) or bs <= 0:
                    raise InputError(f"block_size must be a positive integer, got {bs!r}", path, lineno)
                if block_size is not None and bs != block_size:
                    raise InputError(f"line says block_size {bs} but {block_size} was asked for", path, lineno)
                if bs_seen is None:
                    bs_seen = bs
                elif bs != bs_seen:
                    raise InputError(f"block_size {bs} differs from earlier lines' {bs_seen}", path, lineno)
                if len(ids) != -(-n_in // bs) and len(ids) != n_in // bs:  # Mooncake: ceil; kv-tester: floor
                    raise InputError(
                        f"{len(ids)} hash_ids for input_length {n_in}: expected ceil({n_in}/{bs}) = {-(-n_in // bs)}"
                        f" (block size {bs}; pass --block-size if the trace uses another)", path, lineno)
                ts = d.get("timestamp", 0)
                if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
                    raise InputError(f"timestamp must be a number, got {ts!r}", path, lineno)
                arr = np.asarray(ids)
                if arr.dtype.kind != "i" or arr.ndim != 1:
                    bad = next((h for h in ids if isinstance(h, bool) or not isinstance(h, int)
                                or not -2**63 <= h < 2**63), ids[0])
                    raise InputError(f"hash_ids must hold 64-bit integers, found {bad!r}", path, lineno)
                session = d.get("session")
                chunks.append(arr)
                lens.append(len(ids))
                input_length.append(n_in)
                output_length.append(_int_field(d, "output_length", path, lineno, required=False))
                timestamp.append(float(ts))
                namespace.append(DEFAULT_NAMESPACE if session is None else f"session-{session}")
                lines.append(lineno)
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read trace: {exc}", path) from None
    if not chunks:
        raise InputError("trace holds no requests", path)
    ids_arr = np.concatenate(chunks).astype(np.int64, copy=False)
    del chunks
    offsets = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    return Trace(str(path), bs_seen or MOONCAKE_BLOCK_SIZE, ids_arr, offsets, np.array(input_length, np.int64),
                 np.array(output_length, np.int64), np.array(timestamp, np.float64), namespace,
                 np.array(lines, np.int64))


# ---- scenarios ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Message:
    role: str
    content: str


@dataclass(frozen=True)
class ScenarioRequest:
    """One request of a scenario: exactly one of ``text``, ``messages``, ``tokens``.

    ``conversation``: requests sharing this id form one multi-turn chat; each turn's ``messages`` are only the
    NEW messages, and the history (earlier turns' messages and the replies generated for them) comes first.
    """

    text: str | None = None
    messages: tuple[Message, ...] | None = None
    tokens: tuple[int, ...] | None = None
    conversation: str | None = None
    namespace: str = DEFAULT_NAMESPACE
    timestamp: float | None = None
    max_new_tokens: int | None = None
    line: int | None = None  # where it was written, for error messages

    @property
    def kind(self) -> str:
        return "text" if self.text is not None else "chat" if self.messages is not None else "tokens"


@dataclass(frozen=True)
class Scenario:
    """A workload: either ``requests`` (text/chat/tokens) or a hash-id ``trace``."""

    name: str
    path: str | None = None
    description: str = ""
    requests: tuple[ScenarioRequest, ...] = ()
    trace: Trace | None = field(default=None, repr=False)
    block_size: int | None = None
    capacity: tuple[int, ...] = ()  # default capacities in tokens
    max_new_tokens: int = 16
    seed: int = 0
    model: str | None = None

    @property
    def is_trace(self) -> bool:
        return self.trace is not None

    def __len__(self) -> int:
        return len(self.trace) if self.trace is not None else len(self.requests)


class _LineLoader(yaml.SafeLoader):
    """SafeLoader whose mappings remember their line (``_Map.line``) and each key's line."""


class _Map(dict):
    line: int = 0
    key_lines: dict


def _construct_map(loader: _LineLoader, node: yaml.MappingNode) -> _Map:
    loader.flatten_mapping(node)
    m = _Map()
    m.line = node.start_mark.line + 1
    m.key_lines = {}
    for knode, vnode in node.value:
        key = loader.construct_object(knode, deep=True)
        if not isinstance(key, (str, int, float, bool)) or key is None:
            raise InputError(f"mapping keys must be plain scalars, got {key!r}", None, knode.start_mark.line + 1)
        if key in m:
            raise InputError(f"duplicate key {key!r}", None, knode.start_mark.line + 1)
        m[key] = loader.construct_object(vnode, deep=True)
        m.key_lines[key] = knode.start_mark.line + 1
    return m


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_map)

_SCENARIO_KEYS = {"name", "description", "requests", "generate", "trace", "block_size", "capacity", "max_new_tokens",
                  "seed", "model"}
_REQUEST_KEYS = {"text", "messages", "tokens", "conversation", "namespace", "timestamp", "max_new_tokens", "repeat"}


class _Ctx:
    """Where we are while validating: the file, for error messages."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, message: str, line: int | None = None) -> InputError:
        return InputError(message, self.path, line)

    def check_keys(self, m: Any, known: set[str], what: str, line: int | None) -> _Map:
        if not isinstance(m, dict):
            raise self.fail(f"{what} must be a mapping, got {type(m).__name__}", line)
        for k in m:
            if k not in known:
                kl = getattr(m, "key_lines", {}).get(k, line)
                raise self.fail(f"unknown key {k!r} in {what}; known: {', '.join(sorted(known))}", kl)
        return m  # type: ignore[return-value]

    def line_of(self, m: Any, key: str | None = None) -> int | None:
        if key is not None and hasattr(m, "key_lines") and key in m.key_lines:
            return m.key_lines[key]
        return getattr(m, "line", None)


def _pos_int(ctx: _Ctx, v: Any, what: str, line: int | None, minimum: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ctx.fail(f"{what} must be an integer >= {minimum}, got {v!r}", line)
    return v


def parse_capacity(value: Any, where: str = "capacity") -> int | None:
    """A capacity in tokens: a positive int, or "unlimited"/"inf"/None (None = unlimited). Raises ValueError."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("unlimited", "inf", "none")):
        return None
    if isinstance(value, str):
        s = value.strip().lower().replace("_", "").replace(",", "")
        mult = {"k": 1_000, "m": 1_000_000, "g": 1_000_000_000}.get(s[-1:], 1)
        try:
            number = float(s[:-1] if mult > 1 else s) * mult
        except ValueError:
            raise ValueError(f"{where}: expected a number of tokens or 'unlimited', got {value!r}") from None
        if not math.isfinite(number) or number != int(number):
            raise ValueError(f"{where}: expected a whole number of tokens or 'unlimited', got {value!r}")
        value = int(number)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}: expected a number of tokens or 'unlimited', got {value!r}")
    if value <= 0:
        raise ValueError(f"{where} must be > 0, got {value}")
    return value


def _parse_request(ctx: _Ctx, r: Any, index: int, list_line: int | None) -> list[ScenarioRequest]:
    line = ctx.line_of(r) or list_line
    ctx.check_keys(r, _REQUEST_KEYS, f"request {index + 1}", line)
    kinds = [k for k in ("text", "messages", "tokens") if k in r]
    if len(kinds) != 1:
        raise ctx.fail(f"request {index + 1} needs exactly one of text / messages / tokens, got "
                       f"{', '.join(kinds) or 'none'}", line)
    kw: dict[str, Any] = {"line": line}
    if "text" in r:
        if not isinstance(r["text"], str) or not r["text"]:
            raise ctx.fail("text must be a non-empty string", ctx.line_of(r, "text"))
        kw["text"] = r["text"]
    elif "messages" in r:
        msgs = r["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise ctx.fail("messages must be a non-empty list of {role, content}", ctx.line_of(r, "messages"))
        out = []
        for m in msgs:
            ml = ctx.line_of(m) or ctx.line_of(r, "messages")
            ctx.check_keys(m, {"role", "content"}, "a message", ml)
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ctx.fail("a message needs a string role and a string content", ml)
            out.append(Message(m["role"], m["content"]))
        kw["messages"] = tuple(out)
    else:
        toks = r["tokens"]
        if not isinstance(toks, list) or not toks or any(isinstance(t, bool) or not isinstance(t, int) or t < 0
                                                         for t in toks):
            raise ctx.fail("tokens must be a non-empty list of integers >= 0", ctx.line_of(r, "tokens"))
        kw["tokens"] = tuple(toks)
    if "conversation" in r:
        if "messages" not in r:
            raise ctx.fail("conversation needs messages (a multi-turn chat)", ctx.line_of(r, "conversation"))
        kw["conversation"] = str(r["conversation"])
    if "namespace" in r:
        if not isinstance(r["namespace"], str) or not r["namespace"]:
            raise ctx.fail("namespace must be a non-empty string", ctx.line_of(r, "namespace"))
        kw["namespace"] = r["namespace"]
    if "timestamp" in r:
        ts = r["timestamp"]
        if isinstance(ts, bool) or not isinstance(ts, (int, float)):
            raise ctx.fail(f"timestamp must be a number, got {ts!r}", ctx.line_of(r, "timestamp"))
        kw["timestamp"] = float(ts)
    if "max_new_tokens" in r:
        kw["max_new_tokens"] = _pos_int(ctx, r["max_new_tokens"], "max_new_tokens", ctx.line_of(r, "max_new_tokens"))
    repeat = _pos_int(ctx, r.get("repeat", 1), "repeat", ctx.line_of(r, "repeat"))
    return [ScenarioRequest(**kw)] * repeat


def load_scenario(path: str | Path) -> Scenario:
    """Read a scenario YAML file (format: scenarios/README.md), expanding generators. Changes nothing.

    Raises InputError naming the file, line and key for malformed YAML, unknown keys or bad values.
    A ``.jsonl``/``.jsonl.gz`` path is read as a hash-id trace and wrapped in a Scenario.
    """
    path = Path(path)
    if is_trace_path(path):
        trace = load_trace(path)
        return Scenario(name=path.name, path=str(path), trace=trace, block_size=trace.block_size)
    if not path.is_file():
        raise InputError("no such scenario file", path)
    ctx = _Ctx(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read scenario: {exc}", path) from None
    try:
        doc = yaml.load(text, Loader=_LineLoader)  # noqa: S506 - a SafeLoader subclass
    except InputError as exc:
        raise InputError(exc.message, path, exc.line) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc)
        raise InputError(f"malformed YAML: {problem}", path, mark.line + 1 if mark else None) from None
    ctx.check_keys(doc, _SCENARIO_KEYS, "the scenario", 1)
    sources = [k for k in ("requests", "generate", "trace") if k in doc]
    if not sources:
        raise ctx.fail("a scenario needs requests, generate or trace", 1)
    if "trace" in doc and len(sources) > 1:
        raise ctx.fail("trace cannot be combined with requests or generate", ctx.line_of(doc, "trace"))
    block_size = None
    if "block_size" in doc:
        block_size = _pos_int(ctx, doc["block_size"], "block_size", ctx.line_of(doc, "block_size"))
    caps: list[int] = []
    if "capacity" in doc:
        raw = doc["capacity"] if isinstance(doc["capacity"], list) else [doc["capacity"]]
        for c in raw:
            try:
                cap = parse_capacity(c)
            except ValueError as exc:
                raise ctx.fail(str(exc), ctx.line_of(doc, "capacity")) from None
            caps.append(0 if cap is None else cap)  # 0 = unlimited
    max_new = _pos_int(ctx, doc.get("max_new_tokens", 16), "max_new_tokens", ctx.line_of(doc, "max_new_tokens"))
    seed = _pos_int(ctx, doc.get("seed", 0), "seed", ctx.line_of(doc, "seed"), minimum=0)
    model = doc.get("model")
    if model is not None and not isinstance(model, str):
        raise ctx.fail("model must be a string (preset name or path)", ctx.line_of(doc, "model"))
    common = dict(name=str(doc.get("name", path.stem)), path=str(path), description=str(doc.get("description", "")),
                  capacity=tuple(caps), max_new_tokens=max_new, seed=seed, model=model)
    if "trace" in doc:
        tp = doc["trace"]
        if not isinstance(tp, str):
            raise ctx.fail("trace must be a file path", ctx.line_of(doc, "trace"))
        tpath = (path.parent / tp) if not Path(tp).is_absolute() else Path(tp)
        trace = load_trace(tpath, block_size)
        return Scenario(trace=trace, block_size=trace.block_size, **common)
    requests: list[ScenarioRequest] = []
    if "requests" in doc:
        reqs = doc["requests"]
        if not isinstance(reqs, list) or not reqs:
            raise ctx.fail("requests must be a non-empty list", ctx.line_of(doc, "requests"))
        for i, r in enumerate(reqs):
            requests.extend(_parse_request(ctx, r, i, ctx.line_of(doc, "requests")))
    if "generate" in doc:
        from prefixcache.generators import run_generators  # late: generators imports this module

        requests.extend(run_generators(doc["generate"], seed, ctx))
    return Scenario(requests=tuple(requests), block_size=block_size, **common)
