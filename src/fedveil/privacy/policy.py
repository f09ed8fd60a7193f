"""PoliFL's use-based policies (Policy-Based Federated Learning, Sec. 3.3 and Appendix A): regular
expressions over commands, advanced by Brzozowski derivatives as in Ancile.

**Syntax** (Fig. 8, with ``1`` added): a command ``name`` or ``name(key=value, ...)`` whose values are
numbers, quoted strings (``'..'``, ``".."`` or the paper's typographic quotes) or lists of them;
``P1 . P2`` (sequence), ``P1 + P2`` (union), ``P1 & P2`` (intersection), ``!P`` (negation), ``P*`` (Kleene
star), ``0`` (nothing: no command sequence is allowed) and ``1`` (the empty sequence), with parentheses.
Precedence, loosest first: ``+``, ``&``, ``.``, prefix ``!``, postfix ``*``. :func:`parse` reads it,
:func:`show` prints the canonical form back, and ``parse(show(p)) == p``.

**Matching a call against a policy command** (:func:`matches`): the names must be equal; every keyword
the policy command gives must be present in the call with an equal value (numbers compare as numbers,
``1 == 1.0``; a list compares as the set of its elements, so ``sensors=['mic','loc']`` equals
``sensors=['loc','mic']``); keywords the policy does not mention are unconstrained (``get_data`` allows
``get_data(data_type='reddit')``). One ordering is implied, for privacy budgets only
(:data:`BUDGET_KEYWORDS`): the ``eps`` / ``max_eps`` of ``enforce_dp_budget``, ``enforce_privacy_budget``
and ``check_privacy_budget`` is an upper bound, so a call enforcing a budget at most the policy's
matches (``enforce_dp_budget(eps=1)`` allows ``eps=1`` and ``eps=0.5``, not ``eps=2``): enforcing a
smaller epsilon also enforces the larger one. This is what lets a model trained on two groups with
budgets 1 and 2 be released under both policies (their intersection accepts ``max_eps=1``; PoliFL
Table 4's combined strategy), where equality would leave the intersection empty. Every other value
must be equal; a policy that allows several values lists them as a union.

**E** (Fig. 9): ``E(0) = E(C) = false``, ``E(1) = E(P*) = true``, ``E(P1 . P2) = E(P1 & P2) = E(P1) and
E(P2)``, ``E(P1 + P2) = E(P1) or E(P2)``, ``E(!P) = not E(P)``. **D** (Fig. 10): ``D(0, c) = D(1, c) = 0``,
``D(C, c) = 1`` when ``c`` matches ``C`` else ``0``, ``D(P1 . P2, c) = D(P1, c) . P2 + E(P1) . D(P2, c)``,
``D(P1 + P2, c) = D(P1, c) + D(P2, c)``, ``D(P1 & P2, c) = D(P1, c) & D(P2, c)``,
``D(P*, c) = D(P, c) . P*``, ``D(!P, c) = !D(P, c)``. A sequence of calls is allowed when the policy
advanced by each in turn is nullable (:func:`allows`).

**Canonical form** (the reductions that keep a policy's size bounded as it is advanced): every policy is
built through constructors that apply ``0 . P = P . 0 = 0``, ``1 . P = P . 1 = P``, sequences associated
to the right, ``P + 0 = P``, ``P + !0 = !0``, ``P + P = P`` (a union is a set of alternatives, flattened
and ordered canonically), ``P & 0 = 0``, ``P & !0 = P``, ``P & P = P`` (likewise a set), ``0* = 1* = 1``,
``P** = P*``, ``!!P = P``, and ``1 + P* = P*``. Ancile's reductions stop at some of these (its union and
intersection are binary and unordered, so ``(P + Q) + P`` keeps growing); here they are sets.

**Limits** (a policy comes from an administrator's form or a device's configuration): at most
:data:`MAX_POLICY_CHARS` characters, :data:`MAX_POLICY_NODES` nodes once parsed and
:data:`MAX_POLICY_DEPTH` levels of nesting (open parentheses, list brackets and prefix ``!`` around any
point); beyond them :func:`parse` raises a :class:`PolicySyntaxError` naming the limit. Within them
nothing recurses on the length of a policy: the parser reads unions, intersections and sequences in
loops (a union of 20,000 alternatives parses in well under a second), and a node's hash, size and E are
computed once when it is built, so equality, :func:`derivative`, :func:`show` and the walks over a policy
work with explicit stacks. :func:`parse` keeps the policies it parsed last (keyed by their text, at most
:data:`PARSED_KEPT` of them and :data:`PARSED_KEPT_CHARS` characters of text), so a service that reads
stored policies again on every request parses each once.
"""

from __future__ import annotations

import hashlib
import math
import re
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from fedveil.errors import ConfigError

__all__ = [
    "ANY",
    "BUDGET_KEYWORDS",
    "MAX_POLICY_CHARS",
    "MAX_POLICY_DEPTH",
    "MAX_POLICY_NODES",
    "ONE",
    "PARSED_KEPT",
    "PARSED_KEPT_CHARS",
    "ZERO",
    "Call",
    "Policy",
    "PolicySyntaxError",
    "advance",
    "allows",
    "budget_of",
    "command",
    "derivative",
    "forget_parsed",
    "inter",
    "is_empty",
    "matches",
    "neg",
    "nullable",
    "parse",
    "seq",
    "show",
    "size",
    "star",
    "union",
]

MAX_POLICY_CHARS = 1 << 20
"""The longest policy text :func:`parse` reads (1 MiB of characters)."""

MAX_POLICY_NODES = 100_000
"""The most nodes (:func:`size`) a parsed policy may have."""

MAX_POLICY_DEPTH = 100
"""The deepest nesting of parentheses, list brackets and prefix ``!`` a policy (or a call's list value)
may have."""

PARSED_KEPT = 256
"""How many parsed policies :func:`parse` keeps (the least recently used go first)."""

PARSED_KEPT_CHARS = 16 << 20
"""How many characters of policy text the policies :func:`parse` keeps may have in all."""


class PolicySyntaxError(ConfigError):
    """A policy that does not parse, or is over a limit; the message names the position and what was
    expected, or the limit."""


Value = float | str | frozenset[Any]


def _value(raw: Any, depth: int = 0) -> Value:
    """A keyword value in canonical form: numbers as floats, strings, lists as frozensets (nested at most
    :data:`MAX_POLICY_DEPTH` deep)."""
    if isinstance(raw, bool):
        raise ConfigError(f"a policy value may not be a bool ({raw!r}): use a number or a string")
    if isinstance(raw, (int, float)):
        if not math.isfinite(raw):
            raise ConfigError(f"a policy value must be finite, not {raw!r}")
        return float(raw)
    if isinstance(raw, str):
        return raw
    if isinstance(raw, (list, tuple, set, frozenset)):
        if depth >= MAX_POLICY_DEPTH:
            raise ConfigError(
                f"a policy value's lists nest deeper than the limit of {MAX_POLICY_DEPTH} levels: "
                "flatten the value"
            )
        return frozenset(_value(v, depth + 1) for v in raw)
    raise ConfigError(
        f"a policy value must be a number, a string or a list of them, not {type(raw).__name__}"
    )


@dataclass(frozen=True)
class Call:
    """A command as a program calls it: ``name`` and keyword arguments (canonical values)."""

    name: str
    args: tuple[tuple[str, Value], ...] = ()

    @classmethod
    def of(cls, name: str, args: Mapping[str, Any] | None = None) -> Call:
        """``Call.of("filter", {"sensors": ["mic", "loc"]})``."""
        return cls(name, tuple(sorted((k, _value(v)) for k, v in (args or {}).items())))


# --- printing: the pieces a node prints as (show() below joins them) ----------------------------------------

_LEVEL = {"or": 0, "and": 1, "seq": 2, "not": 3, "star": 4, "cmd": 5, "zero": 5, "one": 5}


def _show_value(v: Value) -> str:
    if isinstance(v, float):
        return str(int(v)) if v.is_integer() and abs(v) < 1e15 else repr(v)
    if isinstance(v, str):
        return "'" + v.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return "[" + ", ".join(sorted(_show_value(x) for x in v)) + "]"


def _show_call(c: Call) -> str:
    if not c.args:
        return c.name
    return c.name + "(" + ", ".join(f"{k}={_show_value(v)}" for k, v in c.args) + ")"


def _wrap(q: Policy, level: int) -> list[Policy | str]:
    return ["(", q, ")"] if _LEVEL[q.kind] < level else [q]


def _pieces(p: Policy) -> list[Policy | str]:
    """The text of ``p``, its children left as nodes to print in their place."""
    if p.kind == "zero":
        return ["0"]
    if p.kind == "one":
        return ["1"]
    if p.kind == "cmd":
        assert p.cmd is not None
        return [_show_call(p.cmd)]
    if p.kind in ("or", "and"):
        between, level = (" + ", 1) if p.kind == "or" else (" & ", 2)
        out: list[Policy | str] = []
        for i, q in enumerate(p.parts):
            out.extend(([between] if i else []) + _wrap(q, level))
        return out
    if p.kind == "seq":
        return [*_wrap(p.parts[0], 3), " . ", *_wrap(p.parts[1], 2)]
    if p.kind == "not":
        return ["!", *_wrap(p.parts[0], 3)]
    return [*_wrap(p.parts[0], 5), "*"]


# --- the policy AST (always built through the canonical constructors below) --------------------------------

_KEY_CHARS = 64
"""How many characters of a policy's text a node keeps to order unions by (:func:`_key`)."""


@dataclass(frozen=True, eq=False, repr=False)
class Policy:
    """A node: ``kind`` is one of ``zero one cmd seq or and not star``; ``parts`` its children (a
    sorted tuple for ``or`` / ``and``); ``cmd`` the command of a ``cmd`` node. Its hash, :func:`size`,
    :func:`nullable` and the first characters of its text are computed from its children's when it is
    built, so none of them walks the policy. The constructors, the parser and unpickling hash-cons nodes
    (:func:`_node`); equality of nodes built otherwise (``Policy(...)`` directly) walks both with a
    stack."""

    kind: str
    parts: tuple[Policy, ...] = ()
    cmd: Call | None = None
    _hash: int = field(init=False, compare=False)
    _size: int = field(init=False, compare=False)
    _nullable: bool = field(init=False, compare=False)
    _prefix: str = field(init=False, compare=False)
    _digest: bytes | None = field(init=False, compare=False, default=None)

    def __post_init__(self) -> None:
        kind, parts = self.kind, self.parts
        if kind in ("zero", "cmd"):
            accepts_empty = False
        elif kind in ("one", "star"):
            accepts_empty = True
        elif kind in ("seq", "and"):
            accepts_empty = all(q._nullable for q in parts)
        elif kind == "or":
            accepts_empty = any(q._nullable for q in parts)
        else:
            accepts_empty = not parts[0]._nullable
        object.__setattr__(self, "_hash", hash((kind, self.cmd, *(q._hash for q in parts))))
        object.__setattr__(self, "_size", 1 + sum(q._size for q in parts))
        object.__setattr__(self, "_nullable", accepts_empty)
        prefix, length = [], 0
        for piece in _pieces(self):
            text = piece if isinstance(piece, str) else piece._prefix
            prefix.append(text)
            length += len(text)
            if length >= _KEY_CHARS:
                break
        object.__setattr__(self, "_prefix", "".join(prefix)[:_KEY_CHARS])

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, Policy):
            return NotImplemented
        if self._hash != other._hash:
            return False
        todo = [(self, other)]
        while todo:
            a, b = todo.pop()
            if a is b:
                continue
            if a._hash != b._hash or a.kind != b.kind or a.cmd != b.cmd or len(a.parts) != len(b.parts):
                return False
            todo.extend(zip(a.parts, b.parts, strict=True))
        return True

    def __reduce__(self) -> tuple[Any, ...]:
        return (_node, (self.kind, self.parts, self.cmd))

    def __str__(self) -> str:
        return show(self)

    def __repr__(self) -> str:
        return f"parse({show(self)!r})"


_NODES: weakref.WeakValueDictionary[tuple[Any, ...], Policy] = weakref.WeakValueDictionary()


def _node(kind: str, parts: tuple[Policy, ...] = (), cmd: Call | None = None) -> Policy:
    """The one node of this structure (hash-consing: the constructors below and the parser build every
    node here, so equal policies they build are the same object and compare in constant time)."""
    key = (kind, cmd, parts)
    found = _NODES.get(key)
    if found is None:
        found = _NODES.setdefault(key, Policy(kind, parts, cmd))
    return found


ZERO = _node("zero")
ONE = _node("one")
ANY = _node("not", (ZERO,))
"""``!0``: every command sequence."""


def command(name: str, args: Mapping[str, Any] | None = None) -> Policy:
    """The policy allowing exactly one call matching ``name(args)``."""
    return _node("cmd", cmd=Call.of(name, args))


def seq(a: Policy, b: Policy) -> Policy:
    """``a . b`` in canonical form (a sequence ``a`` is re-associated to the right, in a loop)."""
    if a == ZERO or b == ZERO:
        return ZERO
    if a == ONE:
        return b
    if b == ONE:
        return a
    heads = []
    while a.kind == "seq":
        heads.append(a.parts[0])
        a = a.parts[1]
    out = _node("seq", (a, b))
    for head in reversed(heads):
        out = _node("seq", (head, out))
    return out


def _digest(p: Policy) -> bytes:
    """A stable 64-bit hash of ``p``'s structure (the same in every process), computed once per node,
    children first, with a stack."""
    todo = [p]
    while todo:
        q = todo[-1]
        missing = [r for r in q.parts if r._digest is None]
        if missing:
            todo.extend(missing)
            continue
        todo.pop()
        if q._digest is None:
            digest = hashlib.blake2b(q.kind.encode(), digest_size=8)
            if q.cmd is not None:
                text = _show_call(q.cmd).encode()
                digest.update(len(text).to_bytes(8, "little") + text)
            for r in q.parts:
                assert r._digest is not None
                digest.update(r._digest)
            object.__setattr__(q, "_digest", digest.digest())
    assert p._digest is not None
    return p._digest


def _key(p: Policy) -> tuple[str] | tuple[str, bytes]:
    """What orders the alternatives of a union (and the conjuncts of an intersection): a policy's text
    when it is shorter than :data:`_KEY_CHARS`, else its first :data:`_KEY_CHARS` characters and its
    :func:`_digest`; so ordering never prints a long policy whole, and the order is the same in every
    process."""
    return (p._prefix,) if len(p._prefix) < _KEY_CHARS else (p._prefix, _digest(p))


def _order(items: Iterable[Policy]) -> tuple[Policy, ...]:
    return tuple(sorted(set(items), key=_key))


def union(*items: Policy) -> Policy:
    """``a + b + ...`` in canonical form (a set of alternatives)."""
    flat: set[Policy] = set()
    for p in items:
        flat.update(p.parts if p.kind == "or" else (p,))
    flat.discard(ZERO)
    if ANY in flat:
        return ANY
    if ONE in flat and any(p.kind == "star" for p in flat):
        flat.discard(ONE)
    if not flat:
        return ZERO
    return next(iter(flat)) if len(flat) == 1 else _node("or", _order(flat))


def inter(*items: Policy) -> Policy:
    """``a & b & ...`` in canonical form (a set of conjuncts)."""
    flat: set[Policy] = set()
    for p in items:
        flat.update(p.parts if p.kind == "and" else (p,))
    if ZERO in flat:
        return ZERO
    flat.discard(ANY)
    if not flat:
        return ANY
    return next(iter(flat)) if len(flat) == 1 else _node("and", _order(flat))


def star(a: Policy) -> Policy:
    """``a*`` in canonical form."""
    if a in (ZERO, ONE):
        return ONE
    if a.kind == "star":
        return a
    return _node("star", (a,))


def neg(a: Policy) -> Policy:
    """``!a`` in canonical form."""
    return a.parts[0] if a.kind == "not" else _node("not", (a,))


def _nodes(p: Policy) -> Iterator[Policy]:
    """Every distinct node of ``p`` once (a stack, no recursion)."""
    seen, todo = {id(p)}, [p]
    while todo:
        q = todo.pop()
        yield q
        for r in q.parts:
            if id(r) not in seen:
                seen.add(id(r))
                todo.append(r)


# --- E and D -----------------------------------------------------------------------------------------------


def nullable(p: Policy) -> bool:
    """E(P) (Fig. 9): whether the empty sequence is allowed (computed when ``p`` was built)."""
    return p._nullable


BUDGET_KEYWORDS: dict[str, str] = {
    "enforce_dp_budget": "eps",
    "enforce_privacy_budget": "max_eps",
    "check_privacy_budget": "max_eps",
}
"""The budget commands and their upper-bound keyword (module docstring)."""


def _equal_or_within(name: str, key: str, bound: Value, given: Value) -> bool:
    if BUDGET_KEYWORDS.get(name) == key and isinstance(bound, float) and isinstance(given, float):
        return given <= bound
    return given == bound


def matches(policy_cmd: Call, call: Call) -> bool:
    """Whether ``call`` is allowed by the policy command ``policy_cmd`` (module docstring)."""
    if policy_cmd.name != call.name:
        return False
    given = dict(call.args)
    return all(k in given and _equal_or_within(call.name, k, v, given[k]) for k, v in policy_cmd.args)


def budget_of(p: Policy) -> float | None:
    """The smallest privacy budget any budget command of ``p`` names (:data:`BUDGET_KEYWORDS`), or
    ``None`` when ``p`` names none: the epsilon a group's data may spend."""
    found = []
    for q in _nodes(p):
        if q.kind == "cmd":
            assert q.cmd is not None
            key = BUDGET_KEYWORDS.get(q.cmd.name)
            value = dict(q.cmd.args).get(key) if key else None
            if isinstance(value, float):
                found.append(value)
    return min(found) if found else None


def _spine(p: Policy) -> Iterator[tuple[Policy, Policy | None]]:
    """A sequence ``p1 . p2 . ... . pn`` as ``(p1, p2 . ... . pn)``, ``(p2, p3 . ... . pn)``, ... as far
    as its heads are nullable, and ``(pn, None)`` when all of ``p1 ... p(n-1)`` are."""
    while p.kind == "seq":
        head, rest = p.parts
        yield head, rest
        if not head._nullable:
            return
        p = rest
    yield p, None


def _needs(p: Policy) -> tuple[Policy, ...]:
    """The nodes whose derivatives D(p, c) is built from: its children, and for a sequence the heads
    that :func:`_spine` reaches (never the rests: D(p1 . R) = D(p1) . R + E(p1) D(R) is expanded along
    the spine at once, one union for the whole sequence)."""
    if p.kind == "seq":
        return tuple(head for head, _ in _spine(p))
    return p.parts


@lru_cache(maxsize=1 << 14)
def derivative(p: Policy, call: Call) -> Policy:
    """D(P, c) (Fig. 10), in canonical form: children first, with a stack rather than recursion, so a
    policy's depth is no limit."""
    done: dict[Policy, Policy] = {}
    todo = [p]
    while todo:
        q = todo[-1]
        if q in done:
            todo.pop()
            continue
        missing = [r for r in _needs(q) if r not in done]
        if missing:
            todo.extend(missing)
            continue
        todo.pop()
        done[q] = _derive(q, call, done)
    return done[p]


def _derive(p: Policy, call: Call, done: Mapping[Policy, Policy]) -> Policy:
    """D(p, c) given the derivatives ``done`` of the children :func:`_needs` names."""
    if p.kind in ("zero", "one"):
        return ZERO
    if p.kind == "cmd":
        assert p.cmd is not None
        return ONE if matches(p.cmd, call) else ZERO
    if p.kind == "seq":
        return union(*(done[head] if rest is None else seq(done[head], rest) for head, rest in _spine(p)))
    if p.kind == "or":
        return union(*(done[q] for q in p.parts))
    if p.kind == "and":
        return inter(*(done[q] for q in p.parts))
    if p.kind == "star":
        return seq(done[p.parts[0]], p)
    return neg(done[p.parts[0]])


def advance(p: Policy, calls: Iterable[Call]) -> Policy:
    """The policy after each call in turn (``0`` once a call is refused)."""
    for c in calls:
        p = derivative(p, c)
    return p


def allows(p: Policy, calls: Sequence[Call]) -> bool:
    """Whether the whole sequence ``calls`` is a word of ``p``."""
    return nullable(advance(p, calls))


def _commands(p: Policy) -> set[Call]:
    return {q.cmd for q in _nodes(p) if q.cmd is not None}


def is_empty(p: Policy, *, limit: int = 10_000) -> bool:
    """Whether ``p`` allows no sequence at all (``a & b``, ``a & !a``, ... are empty without being
    ``0``): a breadth-first search over its derivatives by representative calls (each command ``p``
    names, called with exactly the arguments the policy gives, and one call of a name it does not
    mention); empty when no derivative reached is nullable. Canonical forms keep the derivatives finite;
    ``limit`` bounds the search (beyond it the policy is reported non-empty, the safe answer for a
    check that refuses empty combinations)."""
    alphabet = [*_commands(p), Call("__unnamed_command__")]
    seen, todo = {p}, [p]
    while todo:
        q = todo.pop()
        if nullable(q):
            return False
        for call in alphabet:
            nxt = derivative(q, call)
            if nxt not in seen and nxt != ZERO:
                if len(seen) >= limit:
                    return False
                seen.add(nxt)
                todo.append(nxt)
    return True


def size(p: Policy) -> int:
    """Number of nodes (a command counts one; computed when ``p`` was built)."""
    return p._size


# --- printing ----------------------------------------------------------------------------------------------


def show(p: Policy) -> str:
    """The canonical text of ``p`` (parentheses only where precedence needs them; a stack, no
    recursion)."""
    out: list[str] = []
    todo: list[Policy | str] = [p]
    while todo:
        item = todo.pop()
        if isinstance(item, str):
            out.append(item)
        else:
            todo.extend(reversed(_pieces(item)))
    return "".join(out)


# --- parsing -----------------------------------------------------------------------------------------------

_TOKEN = re.compile(
    r"""\s*(?:
    (?P<num>-?\d+\.\d+(?:[eE][-+]?\d+)?|-?\d+(?:[eE][-+]?\d+)?)(?![A-Za-z_])
  | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<str>'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|‘[^’]*’|“[^”]*”)
  | (?P<op>[().+&!*,=\[\]])
  | (?P<bad>\S)
    )""",
    re.VERBOSE,
)


def _excerpt(text: str, limit: int = 80) -> str:
    """``text`` quoted, cut to ``limit`` characters for an error message."""
    return repr(text) if len(text) <= limit else repr(text[: limit - 3]) + f"... ({len(text)} characters)"


class _Parser:
    """Recursive descent over the precedence levels; the recursion is on nesting only (bounded by
    :data:`MAX_POLICY_DEPTH`), the operators of one level are read in a loop."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens: list[tuple[str, str, int]] = []
        self.depth = 0
        for m in _TOKEN.finditer(text):
            kind, group = m.lastgroup, m.lastindex
            if kind == "bad" or kind is None or group is None:
                pos = m.end() - 1
                raise PolicySyntaxError(
                    f"policy {_excerpt(text)}: cannot read {text[pos : pos + 12]!r} at position {pos}"
                )
            self.tokens.append((kind, m.group(group), m.start(group)))
        self.tokens.append(("end", "", len(text)))
        self.texts = [tok[1] for tok in self.tokens]  # what eat() compares an operator with
        self.i = 0

    def peek(self) -> tuple[str, str, int] | None:
        tok = self.tokens[self.i]
        return None if tok[0] == "end" else tok

    def fail(self, expected: str) -> PolicySyntaxError:
        tok = self.peek()
        where = f"{tok[1]!r} at position {tok[2]}" if tok else "the end"
        return PolicySyntaxError(f"policy {_excerpt(self.text)}: expected {expected}, found {where}")

    def eat(self, op: str) -> bool:
        """Take the next token if it is the operator ``op`` (no other token's text is an operator's)."""
        if self.texts[self.i] == op:
            self.i += 1
            return True
        return False

    def expect(self, op: str) -> None:
        if not self.eat(op):
            raise self.fail(repr(op))

    def nest(self, levels: int) -> None:
        """Enter ``levels`` more levels of nesting (a negative number leaves them)."""
        self.depth += levels
        if self.depth > MAX_POLICY_DEPTH:
            tok = self.tokens[self.i - 1]
            raise PolicySyntaxError(
                f"policy {_excerpt(self.text)} nests deeper than the limit of {MAX_POLICY_DEPTH} levels "
                f"(parentheses, brackets and '!') at position {tok[2]}: write it with less nesting"
            )

    def policy(self) -> Policy:
        alternatives = [self.conj()]
        while self.eat("+"):
            alternatives.append(self.conj())
        return alternatives[0] if len(alternatives) == 1 else union(*alternatives)

    def conj(self) -> Policy:
        conjuncts = [self.sequence()]
        while self.eat("&"):
            conjuncts.append(self.sequence())
        return conjuncts[0] if len(conjuncts) == 1 else inter(*conjuncts)

    def sequence(self) -> Policy:
        parts = [self.unary()]
        while self.eat("."):
            parts.append(self.unary())
        out = parts[-1]
        for p in reversed(parts[:-1]):
            out = seq(p, out)
        return out

    def unary(self) -> Policy:
        negations = 0
        while self.eat("!"):
            negations += 1
        self.nest(negations)
        out = self.atom()
        while self.eat("*"):
            out = star(out)
        self.nest(-negations)
        for _ in range(negations % 2):
            out = neg(out)
        return out

    def atom(self) -> Policy:
        tok = self.peek()
        if tok is None:
            raise self.fail("a command, 0, 1, ! or (")
        kind, text, _ = tok
        if kind == "op" and text == "(":
            self.i += 1
            self.nest(1)
            out = self.policy()
            self.expect(")")
            self.nest(-1)
            return out
        if kind == "num" and text in ("0", "1"):
            self.i += 1
            return ZERO if text == "0" else ONE
        if kind == "name":
            self.i += 1
            args: dict[str, Value] = {}
            if self.eat("(") and not self.eat(")"):
                while True:
                    key = self.peek()
                    if key is None or key[0] != "name":
                        raise self.fail("a keyword")
                    self.i += 1
                    self.expect("=")
                    if key[1] in args:
                        raise PolicySyntaxError(
                            f"policy {_excerpt(self.text)}: keyword {key[1]!r} given twice"
                        )
                    args[key[1]] = self.value()
                    if self.eat(")"):
                        break
                    self.expect(",")
            return _node("cmd", cmd=Call(text, tuple(sorted(args.items()))))
        raise self.fail("a command, 0, 1, ! or (")

    def value(self) -> Value:
        tok = self.peek()
        if tok is None:
            raise self.fail("a value")
        kind, text, _ = tok
        if kind == "op" and text == "[":
            self.i += 1
            self.nest(1)
            items: list[Value] = []
            if not self.eat("]"):
                while True:
                    items.append(self.value())
                    if self.eat("]"):
                        break
                    self.expect(",")
            self.nest(-1)
            return frozenset(items)
        self.i += 1
        if kind == "num":
            return _value(float(text))
        if kind == "str":
            body = text[1:-1]
            return re.sub(r"\\(.)", r"\1", body) if text[0] in "'\"" else body
        self.i -= 1
        raise self.fail("a number, a string or a list")


class _Kept:
    """The policies parsed last, keyed by their text: at most :data:`PARSED_KEPT` of them and
    :data:`PARSED_KEPT_CHARS` characters of text, the least recently used dropped first."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.policies: OrderedDict[str, Policy] = OrderedDict()
        self.chars = 0

    def get(self, text: str) -> Policy | None:
        with self.lock:
            found = self.policies.get(text)
            if found is not None:
                self.policies.move_to_end(text)
            return found

    def put(self, text: str, policy: Policy) -> None:
        with self.lock:
            if text not in self.policies:
                self.policies[text] = policy
                self.chars += len(text)
            while len(self.policies) > PARSED_KEPT or self.chars > PARSED_KEPT_CHARS:
                old, _ = self.policies.popitem(last=False)
                self.chars -= len(old)

    def clear(self) -> None:
        with self.lock:
            self.policies.clear()
            self.chars = 0


_KEPT = _Kept()


def forget_parsed() -> None:
    """Drop the policies :func:`parse` keeps (a benchmark timing the parser itself calls it)."""
    _KEPT.clear()


def parse(text: str) -> Policy:
    """The policy ``text`` in canonical form (module docstring); a :class:`PolicySyntaxError` names the
    position of what does not parse, or the limit (:data:`MAX_POLICY_CHARS`, :data:`MAX_POLICY_NODES`,
    :data:`MAX_POLICY_DEPTH`) a policy is over. A text parsed recently is not parsed again."""
    if not isinstance(text, str) or not text.strip():
        given = _excerpt(text) if isinstance(text, str) else type(text).__name__
        raise PolicySyntaxError(f"a policy must be non-empty text, not {given}")
    kept = _KEPT.get(text)
    if kept is not None:
        return kept
    if len(text) > MAX_POLICY_CHARS:
        raise PolicySyntaxError(
            f"policy {_excerpt(text)} is longer than the limit of {MAX_POLICY_CHARS} characters: "
            "split it or write it shorter"
        )
    parser = _Parser(text)
    out = parser.policy()
    if parser.peek() is not None:
        raise parser.fail("an operator (+ & . *) or the end")
    if size(out) > MAX_POLICY_NODES:
        raise PolicySyntaxError(
            f"policy {_excerpt(text)} has {size(out)} nodes, over the limit of {MAX_POLICY_NODES}: "
            "write it with fewer commands and operators"
        )
    _KEPT.put(text, out)
    return out
