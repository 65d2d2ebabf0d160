"""Scenarios (YAML, see scenarios/README.md): requests as text, chat messages, raw token ids, a seeded
generator, or a pointer to a hash-id trace. ``load_scenario(path)`` returns a :class:`Scenario`; every
problem raises InputError naming the file, the line and the key."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from prefixcache.core.errors import InputError, shown
from prefixcache.workload.files import MiB, input_file, read_text
from prefixcache.workload.generators import run_generators
from prefixcache.workload.requests import (
    MAX_REQUESTS,
    MAX_TOKENS,
    ImageRef,
    Message,
    ScenarioRequest,
    finite_number,
)
from prefixcache.workload.trace import Trace, is_trace_path, load_trace
from prefixcache.workload.yaml_lines import LineLoader, YamlContext, pos_int, scalar_text


@dataclass(frozen=True)
class Scenario:
    """A workload: either ``requests`` (text/chat/tokens) or a hash-id ``trace``."""

    name: str
    path: str | None = None
    description: str = ""
    requests: tuple[ScenarioRequest, ...] = ()
    trace: Trace | None = field(default=None, repr=False)
    block_size: int | None = None
    capacity: tuple[int | None, ...] = ()  # default capacities in tokens (None: unlimited)
    max_new_tokens: int = 16
    seed: int = 0
    model: str | None = None

    @property
    def is_trace(self) -> bool:
        return self.trace is not None

    def __len__(self) -> int:
        return len(self.trace) if self.trace is not None else len(self.requests)


_SCENARIO_KEYS = {
    "name",
    "description",
    "requests",
    "generate",
    "trace",
    "block_size",
    "capacity",
    "max_new_tokens",
    "seed",
    "model",
}
_REQUEST_KEYS = {"text", "messages", "tokens", "conversation", "namespace", "timestamp", "max_new_tokens", "repeat"}
MAX_SCENARIO_BYTES = 64 * MiB


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
            raise ValueError(f"{where}: expected a number of tokens or 'unlimited', got {shown(value)}") from None
        if not math.isfinite(number) or number != int(number):
            raise ValueError(f"{where}: expected a whole number of tokens or 'unlimited', got {shown(value)}")
        value = int(number)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}: expected a number of tokens or 'unlimited', got {shown(value)}")
    if value <= 0:
        raise ValueError(f"{where} must be > 0, got {value}")
    return value


def _parse_request(ctx: YamlContext, r: Any, index: int, list_line: int | None) -> list[ScenarioRequest]:
    line = ctx.line_of(r) or list_line
    ctx.check_keys(r, _REQUEST_KEYS, f"request {index + 1}", line)
    kinds = [k for k in ("text", "messages", "tokens") if k in r]
    if len(kinds) != 1:
        raise ctx.fail(
            f"request {index + 1} needs exactly one of text / messages / tokens, got {', '.join(kinds) or 'none'}", line
        )
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
            ctx.check_keys(m, {"role", "content", "images"}, "a message", ml)
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ctx.fail("a message needs a string role and a string content", ml)
            out.append(Message(m["role"], m["content"], _parse_images(ctx, m, ml)))
        kw["messages"] = tuple(out)
    else:
        toks = r["tokens"]
        if (
            not isinstance(toks, list)
            or not toks
            or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in toks)
        ):
            raise ctx.fail("tokens must be a non-empty list of integers >= 0", ctx.line_of(r, "tokens"))
        kw["tokens"] = tuple(toks)
    if "conversation" in r:
        if "messages" not in r:
            raise ctx.fail("conversation needs messages (a multi-turn chat)", ctx.line_of(r, "conversation"))
        kw["conversation"] = scalar_text(ctx, r["conversation"], "conversation", ctx.line_of(r, "conversation"))
    if "namespace" in r:
        if not isinstance(r["namespace"], str) or not r["namespace"]:
            raise ctx.fail("namespace must be a non-empty string", ctx.line_of(r, "namespace"))
        kw["namespace"] = r["namespace"]
    if "timestamp" in r:
        ts = r["timestamp"]
        if not finite_number(ts):
            raise ctx.fail(f"timestamp must be a finite number, got {shown(ts)}", ctx.line_of(r, "timestamp"))
        kw["timestamp"] = float(ts)
    if "max_new_tokens" in r:
        line_k = ctx.line_of(r, "max_new_tokens")
        kw["max_new_tokens"] = pos_int(ctx, r["max_new_tokens"], "max_new_tokens", line_k, maximum=MAX_TOKENS)
    repeat = pos_int(ctx, r.get("repeat", 1), "repeat", ctx.line_of(r, "repeat"), maximum=MAX_REQUESTS)
    return [ScenarioRequest(**kw)] * repeat


def _parse_images(ctx: YamlContext, m: Any, line: int | None) -> tuple[ImageRef, ...]:
    """A message's ``images``: a list of {id: content id, tokens: placeholder tokens}."""
    if "images" not in m:
        return ()
    items, where = m["images"], ctx.line_of(m, "images") or line
    if not isinstance(items, list) or not items:
        raise ctx.fail("images must be a non-empty list of {id, tokens}", where)
    out = []
    for item in items:
        il = ctx.line_of(item) or where
        ctx.check_keys(item, {"id", "tokens"}, "an image", il)
        name = scalar_text(ctx, item.get("id"), "an image's id", il) if item.get("id") is not None else None
        if not name:
            raise ctx.fail("an image needs an id (equal ids: the same picture)", il)
        tokens = pos_int(
            ctx, item.get("tokens"), "an image's tokens", ctx.line_of(item, "tokens") or il, maximum=MAX_TOKENS
        )
        out.append(ImageRef(name, tokens))
    return tuple(out)


def _check_count(ctx: YamlContext, requests: list[ScenarioRequest], line: int | None) -> None:
    if len(requests) > MAX_REQUESTS:
        raise ctx.fail(f"the scenario expands to more than {MAX_REQUESTS:,} requests", line)


def load_scenario(path: str | Path) -> Scenario:
    """Read a scenario YAML file (format: scenarios/README.md), expanding generators. Changes nothing.

    Raises InputError naming the file, line and key for malformed YAML, unknown keys or bad values.
    A ``.jsonl``/``.jsonl.gz`` path is read as a hash-id trace and wrapped in a Scenario.
    """
    path = Path(path)
    if is_trace_path(path):
        trace = load_trace(path)
        return Scenario(name=path.name, path=str(path), trace=trace, block_size=trace.block_size)
    path = input_file(path, "scenario file")
    ctx = YamlContext(path)
    text = read_text(path, "scenario file", MAX_SCENARIO_BYTES)
    try:
        doc = yaml.load(text, Loader=LineLoader)
    except InputError as exc:
        raise InputError(exc.message, path, exc.line) from None
    except yaml.reader.ReaderError as exc:  # a control character; its message spans lines
        line = text.count("\n", 0, exc.position) + 1
        raise InputError(f"malformed YAML: character {exc.character!r} is not allowed", path, line) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = " ".join(str(getattr(exc, "problem", None) or exc).split())
        raise InputError(f"malformed YAML: {problem}", path, mark.line + 1 if mark else None) from None
    except RecursionError:
        raise InputError("malformed YAML: nested too deeply", path) from None
    except (ValueError, TypeError, OverflowError) as exc:  # a constructor's conversion: a 5000-digit int, a bad date
        raise InputError(f"malformed YAML: {exc}", path) from None
    ctx.check_keys(doc, _SCENARIO_KEYS, "the scenario", 1)
    sources = [k for k in ("requests", "generate", "trace") if k in doc]
    if not sources:
        raise ctx.fail("a scenario needs requests, generate or trace", 1)
    if "trace" in doc and len(sources) > 1:
        raise ctx.fail("trace cannot be combined with requests or generate", ctx.line_of(doc, "trace"))
    block_size = None
    if "block_size" in doc:
        block_size = pos_int(ctx, doc["block_size"], "block_size", ctx.line_of(doc, "block_size"))
    caps: list[int | None] = []
    if "capacity" in doc:
        raw = doc["capacity"] if isinstance(doc["capacity"], list) else [doc["capacity"]]
        for c in raw:
            try:
                cap = parse_capacity(c)
            except ValueError as exc:
                raise ctx.fail(str(exc), ctx.line_of(doc, "capacity")) from None
            caps.append(cap)
    max_new = pos_int(
        ctx, doc.get("max_new_tokens", 16), "max_new_tokens", ctx.line_of(doc, "max_new_tokens"), maximum=MAX_TOKENS
    )
    seed = pos_int(ctx, doc.get("seed", 0), "seed", ctx.line_of(doc, "seed"), minimum=0)
    model = doc.get("model")
    if model is not None and not isinstance(model, str):
        raise ctx.fail("model must be a string (preset name or path)", ctx.line_of(doc, "model"))
    common: dict[str, Any] = dict(
        name=scalar_text(ctx, doc.get("name", path.stem), "name", ctx.line_of(doc, "name")),
        path=str(path),
        description=scalar_text(ctx, doc.get("description", ""), "description", ctx.line_of(doc, "description")),
        capacity=tuple(caps),
        max_new_tokens=max_new,
        seed=seed,
        model=model,
    )
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
            _check_count(ctx, requests, ctx.line_of(r) or ctx.line_of(doc, "requests"))
    if "generate" in doc:
        requests.extend(run_generators(doc["generate"], seed, ctx))
        _check_count(ctx, requests, ctx.line_of(doc, "generate"))
    return Scenario(requests=tuple(requests), block_size=block_size, **common)
