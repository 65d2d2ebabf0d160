"""Seeded generators of common request shapes, for scenarios' ``generate:`` section.

Each generator returns a list of ScenarioRequest; the same arguments and seed give the same requests.
Lengths are in characters of ASCII text, i.e. tokens of the built-in byte-level tokenizer (a real
model's tokenizer packs several characters per token). Registry: ``GENERATORS[name]``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import numpy as np

from prefixcache.core import DEFAULT_NAMESPACE
from prefixcache.core.errors import shown
from prefixcache.workload.requests import MAX_REQUESTS, MAX_TOKENS, Message, ScenarioRequest, finite_number
from prefixcache.workload.yaml_lines import YamlContext, pos_int

_LETTERS = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", dtype=np.uint8)


def _text(rng: np.random.Generator, n: int, label: str = "") -> str:
    """``n`` characters of seeded pseudo-words, starting with ``label``."""
    out = bytearray(label.encode("ascii"))
    while len(out) < n:
        word = rng.choice(_LETTERS, size=int(rng.integers(2, 9))).tobytes()
        out += (b" " if out else b"") + word
    return out[:n].decode("ascii")


def _ns(namespace: str, tenants: int, i: int) -> str:
    return namespace if tenants <= 1 else f"{namespace}-{i % tenants}"


def shared_prompt(
    rng: np.random.Generator,
    users: int = 50,
    system_prompt_tokens: int = 1500,
    question_tokens: int = 64,
    tenants: int = 1,
    namespace: str = DEFAULT_NAMESPACE,
    max_new_tokens: int | None = None,
) -> list[ScenarioRequest]:
    """One shared system prompt, then one distinct question per user (chat). ``tenants`` > 1 splits the users
    over that many namespaces, which never share blocks."""
    system = _text(rng, system_prompt_tokens, "You are a helpful assistant. ")
    return [
        ScenarioRequest(
            messages=(Message("system", system), Message("user", _text(rng, question_tokens, f"Q{u}: "))),
            namespace=_ns(namespace, tenants, u),
            max_new_tokens=max_new_tokens,
        )
        for u in range(users)
    ]


def chat(
    rng: np.random.Generator,
    users: int = 20,
    turns: int = 5,
    system_prompt_tokens: int = 1500,
    user_tokens: int = 64,
    interleave: bool = True,
    tenants: int = 1,
    namespace: str = DEFAULT_NAMESPACE,
    max_new_tokens: int | None = None,
) -> list[ScenarioRequest]:
    """Multi-turn chats: every user shares the system prompt; each turn resends the history and the replies.
    ``interleave``: turns of different users alternate (round robin), else one user's chat after another."""
    system = _text(rng, system_prompt_tokens, "You are a helpful assistant. ")
    per_user = []
    for u in range(users):
        reqs = []
        for t in range(turns):
            msgs: tuple[Message, ...] = (Message("user", _text(rng, user_tokens, f"U{u}T{t}: ")),)
            if t == 0:
                msgs = (Message("system", system), *msgs)
            reqs.append(
                ScenarioRequest(
                    messages=msgs,
                    conversation=f"user-{u}",
                    namespace=_ns(namespace, tenants, u),
                    max_new_tokens=max_new_tokens,
                )
            )
        per_user.append(reqs)
    if interleave:
        return [per_user[u][t] for t in range(turns) for u in range(users)]
    return [r for reqs in per_user for r in reqs]


def few_shot(
    rng: np.random.Generator,
    requests: int = 50,
    examples: int = 8,
    example_tokens: int = 120,
    query_tokens: int = 48,
    namespace: str = DEFAULT_NAMESPACE,
    max_new_tokens: int | None = None,
) -> list[ScenarioRequest]:
    """A fixed instruction + ``examples`` worked examples (the shared template), then a distinct query (text)."""
    head = _text(rng, 80, "Classify the sentiment of each review. ")
    shots = "".join(
        f"\nReview: {_text(rng, example_tokens - 20)}\nLabel: {'pos' if k % 2 else 'neg'}" for k in range(examples)
    )
    return [
        ScenarioRequest(
            text=f"{head}{shots}\nReview: {_text(rng, query_tokens, f'R{i} ')}\nLabel:",
            namespace=namespace,
            max_new_tokens=max_new_tokens,
        )
        for i in range(requests)
    ]


def rag(
    rng: np.random.Generator,
    requests: int = 100,
    documents: int = 50,
    document_tokens: int = 300,
    docs_per_request: int = 2,
    zipf: float = 1.1,
    system_prompt_tokens: int = 200,
    query_tokens: int = 48,
    namespace: str = DEFAULT_NAMESPACE,
    max_new_tokens: int | None = None,
) -> list[ScenarioRequest]:
    """Retrieval-augmented prompts: system prompt, ``docs_per_request`` documents drawn from a pool with Zipf
    popularity (document k has weight 1/k**zipf; drawn without repeats, in retrieval order), then a query.
    Prompts share a prefix up to the first document that differs."""
    if docs_per_request > documents:
        raise ValueError(f"docs_per_request ({docs_per_request}) > documents ({documents})")
    system = _text(rng, system_prompt_tokens, "Answer from the documents. ")
    pool = [_text(rng, document_tokens, f"[doc {k}] ") for k in range(documents)]
    weights = 1.0 / np.arange(1, documents + 1) ** zipf
    weights /= weights.sum()
    out = []
    for i in range(requests):
        picks = rng.choice(documents, size=docs_per_request, replace=False, p=weights)
        docs = "\n".join(pool[k] for k in picks)
        out.append(
            ScenarioRequest(
                messages=(
                    Message("system", system),
                    Message("user", f"{docs}\nQuestion: {_text(rng, query_tokens, f'q{i} ')}"),
                ),
                namespace=namespace,
                max_new_tokens=max_new_tokens,
            )
        )
    return out


def agent(
    rng: np.random.Generator,
    agents: int = 4,
    steps: int = 8,
    system_prompt_tokens: int = 800,
    task_tokens: int = 100,
    tool_output_tokens: int = 200,
    interleave: bool = True,
    namespace: str = DEFAULT_NAMESPACE,
    max_new_tokens: int | None = None,
) -> list[ScenarioRequest]:
    """Agent loops: a task, then each step appends the model's reply (a tool call) and the tool's output, so
    the transcript grows and every step resends all of it."""
    system = _text(rng, system_prompt_tokens, "You are an agent with tools: search, read, run. ")
    per_agent = []
    for a in range(agents):
        reqs = [
            ScenarioRequest(
                messages=(Message("system", system), Message("user", _text(rng, task_tokens, f"Task {a}: "))),
                conversation=f"agent-{a}",
                namespace=namespace,
                max_new_tokens=max_new_tokens,
            )
        ]
        for s in range(1, steps):
            reqs.append(
                ScenarioRequest(
                    messages=(Message("user", _text(rng, tool_output_tokens, f"[tool output {s}] ")),),
                    conversation=f"agent-{a}",
                    namespace=namespace,
                    max_new_tokens=max_new_tokens,
                )
            )
        per_agent.append(reqs)
    if interleave:
        return [per_agent[a][s] for s in range(steps) for a in range(agents)]
    return [r for reqs in per_agent for r in reqs]


def parallel_samples(
    rng: np.random.Generator,
    prompts: int = 10,
    samples: int = 4,
    prompt_tokens: int = 500,
    namespace: str = DEFAULT_NAMESPACE,
    max_new_tokens: int | None = None,
) -> list[ScenarioRequest]:
    """``samples`` requests of the same prompt in a row (best-of-n, self-consistency): all but the first hit."""
    out = []
    for p in range(prompts):
        text = _text(rng, prompt_tokens, f"Problem {p}: ")
        out.extend([ScenarioRequest(text=text, namespace=namespace, max_new_tokens=max_new_tokens)] * samples)
    return out


GENERATORS: dict[str, Callable[..., list[ScenarioRequest]]] = {
    "shared_prompt": shared_prompt,
    "chat": chat,
    "few_shot": few_shot,
    "rag": rag,
    "agent": agent,
    "parallel_samples": parallel_samples,
}


def generate(shape: str, seed: int = 0, **params: Any) -> list[ScenarioRequest]:
    """Run generator ``shape`` with ``params`` and a seeded RNG. Raises ValueError on an unknown shape/param."""
    if shape not in GENERATORS:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(GENERATORS)}")
    fn = GENERATORS[shape]
    sig = inspect.signature(fn)
    known = [p for p in sig.parameters if p != "rng"]
    for k, v in params.items():
        if k not in known:
            raise ValueError(f"unknown key {k!r} for shape {shape!r}; known: {', '.join(known)}")
        default = sig.parameters[k].default
        if isinstance(default, bool):
            if not isinstance(v, bool):
                raise ValueError(f"{k} must be true or false, got {shown(v)}")
        elif isinstance(default, int) or k == "max_new_tokens":  # counts and lengths
            lo = 0 if k.endswith("_tokens") and k != "max_new_tokens" else 1
            hi = MAX_TOKENS if k.endswith("_tokens") else MAX_REQUESTS
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ValueError(f"{k} must be an integer in [{lo}, {hi:,}], got {shown(v)}")
        elif isinstance(default, float):
            if not finite_number(v) or v <= 0:
                raise ValueError(f"{k} must be a positive number, got {shown(v)}")
        elif isinstance(default, str) and (not isinstance(v, str) or not v):
            raise ValueError(f"{k} must be a non-empty string, got {shown(v)}")
    return fn(np.random.default_rng(seed), **params)


def run_generators(spec: Any, seed: int, ctx: YamlContext) -> list[ScenarioRequest]:
    """Expand a scenario's ``generate:`` value (one mapping or a list of them, each with ``shape``).

    ``ctx`` turns problems into InputError with the file and line."""
    specs = spec if isinstance(spec, list) else [spec]
    out: list[ScenarioRequest] = []
    for k, s in enumerate(specs):
        line = ctx.line_of(s)
        if not isinstance(s, dict) or not isinstance(s.get("shape"), str):
            raise ctx.fail(f"generate entry {k + 1} must be a mapping with a 'shape' ({', '.join(GENERATORS)})", line)
        params = {str(key): v for key, v in s.items() if key not in ("shape", "seed")}
        spec_seed = pos_int(ctx, s.get("seed", seed + k), "seed", ctx.line_of(s, "seed"), minimum=0)
        try:
            out.extend(generate(s["shape"], seed=spec_seed, **params))
        except ValueError as exc:
            msg = str(exc)
            bad = next((key for key in params if repr(key) in msg or msg.startswith(f"{key} ")), None)
            raise ctx.fail(str(exc), ctx.line_of(s, bad) if bad else line) from None
    return out
