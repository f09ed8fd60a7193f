"""PoliFL's use-based policies (003_d27972a5478cff69.txt, Sec. 3.3 and Appendix A): regular expressions
over commands, advanced by Brzozowski derivatives as in Ancile.

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
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from fedveil.errors import ConfigError

__all__ = [
    "ANY",
    "BUDGET_KEYWORDS",
    "ONE",
    "ZERO",
    "Call",
    "Policy",
    "PolicySyntaxError",
    "advance",
    "allows",
    "budget_of",
    "command",
    "derivative",
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


class PolicySyntaxError(ConfigError):
    """A policy that does not parse; the message names the position and what was expected."""


Value = float | str | frozenset[Any]


def _value(raw: Any) -> Value:
    """A keyword value in canonical form: numbers as floats, strings, lists as frozensets."""
    if isinstance(raw, bool):
        raise ConfigError(f"a policy value may not be a bool ({raw!r}): use a number or a string")
    if isinstance(raw, (int, float)):
        if not math.isfinite(raw):
            raise ConfigError(f"a policy value must be finite, not {raw!r}")
        return float(raw)
    if isinstance(raw, str):
        return raw
    if isinstance(raw, (list, tuple, set, frozenset)):
        return frozenset(_value(v) for v in raw)
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


# --- the policy AST (always built through the canonical constructors below) --------------------------------


@dataclass(frozen=True)
class Policy:
    """A node: ``kind`` is one of ``zero one cmd seq or and not star``; ``parts`` its children (a
    sorted tuple for ``or`` / ``and``); ``cmd`` the command of a ``cmd`` node."""

    kind: str
    parts: tuple[Policy, ...] = ()
    cmd: Call | None = None

    def __str__(self) -> str:
        return show(self)


ZERO = Policy("zero")
ONE = Policy("one")
ANY = Policy("not", (ZERO,))
"""``!0``: every command sequence."""


def command(name: str, args: Mapping[str, Any] | None = None) -> Policy:
    """The policy allowing exactly one call matching ``name(args)``."""
    return Policy("cmd", cmd=Call.of(name, args))


def seq(a: Policy, b: Policy) -> Policy:
    """``a . b`` in canonical form."""
    if a == ZERO or b == ZERO:
        return ZERO
    if a == ONE:
        return b
    if b == ONE:
        return a
    if a.kind == "seq":
        return seq(a.parts[0], seq(a.parts[1], b))
    return Policy("seq", (a, b))


def _order(items: Iterable[Policy]) -> tuple[Policy, ...]:
    return tuple(sorted(set(items), key=show))


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
    return next(iter(flat)) if len(flat) == 1 else Policy("or", _order(flat))


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
    return next(iter(flat)) if len(flat) == 1 else Policy("and", _order(flat))


def star(a: Policy) -> Policy:
    """``a*`` in canonical form."""
    if a in (ZERO, ONE):
        return ONE
    if a.kind == "star":
        return a
    return Policy("star", (a,))


def neg(a: Policy) -> Policy:
    """``!a`` in canonical form."""
    return a.parts[0] if a.kind == "not" else Policy("not", (a,))


# --- E and D -----------------------------------------------------------------------------------------------


@cache
def nullable(p: Policy) -> bool:
    """E(P) (Fig. 9): whether the empty sequence is allowed."""
    if p.kind in ("zero", "cmd"):
        return False
    if p.kind in ("one", "star"):
        return True
    if p.kind in ("seq", "and"):
        return all(nullable(q) for q in p.parts)
    if p.kind == "or":
        return any(nullable(q) for q in p.parts)
    return not nullable(p.parts[0])


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
    if p.kind == "cmd":
        assert p.cmd is not None
        key = BUDGET_KEYWORDS.get(p.cmd.name)
        value = dict(p.cmd.args).get(key) if key else None
        return value if isinstance(value, float) else None
    found = [b for q in p.parts if (b := budget_of(q)) is not None]
    return min(found) if found else None


@cache
def derivative(p: Policy, call: Call) -> Policy:
    """D(P, c) (Fig. 10), in canonical form."""
    if p.kind in ("zero", "one"):
        return ZERO
    if p.kind == "cmd":
        assert p.cmd is not None
        return ONE if matches(p.cmd, call) else ZERO
    if p.kind == "seq":
        a, b = p.parts
        first = seq(derivative(a, call), b)
        return union(first, derivative(b, call)) if nullable(a) else first
    if p.kind == "or":
        return union(*(derivative(q, call) for q in p.parts))
    if p.kind == "and":
        return inter(*(derivative(q, call) for q in p.parts))
    if p.kind == "star":
        return seq(derivative(p.parts[0], call), p)
    return neg(derivative(p.parts[0], call))


def advance(p: Policy, calls: Iterable[Call]) -> Policy:
    """The policy after each call in turn (``0`` once a call is refused)."""
    for c in calls:
        p = derivative(p, c)
    return p


def allows(p: Policy, calls: Sequence[Call]) -> bool:
    """Whether the whole sequence ``calls`` is a word of ``p``."""
    return nullable(advance(p, calls))


def _commands(p: Policy) -> set[Call]:
    if p.kind == "cmd":
        assert p.cmd is not None
        return {p.cmd}
    return set().union(*(_commands(q) for q in p.parts)) if p.parts else set()


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
    """Number of nodes (a command counts one)."""
    return 1 + sum(size(q) for q in p.parts)


# --- printing ----------------------------------------------------------------------------------------------

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


def show(p: Policy) -> str:
    """The canonical text of ``p`` (parentheses only where precedence needs them)."""

    def wrap(q: Policy, level: int) -> str:
        text = show(q)
        return f"({text})" if _LEVEL[q.kind] < level else text

    if p.kind == "zero":
        return "0"
    if p.kind == "one":
        return "1"
    if p.kind == "cmd":
        assert p.cmd is not None
        return _show_call(p.cmd)
    if p.kind == "or":
        return " + ".join(wrap(q, 1) for q in p.parts)
    if p.kind == "and":
        return " & ".join(wrap(q, 2) for q in p.parts)
    if p.kind == "seq":
        return f"{wrap(p.parts[0], 3)} . {wrap(p.parts[1], 2)}"
    if p.kind == "not":
        return "!" + wrap(p.parts[0], 3)
    return wrap(p.parts[0], 5) + "*"


# --- parsing -----------------------------------------------------------------------------------------------

_TOKEN = re.compile(
    r"""\s*(?:
    (?P<num>-?\d+\.\d+(?:[eE][-+]?\d+)?|-?\d+(?:[eE][-+]?\d+)?)(?![A-Za-z_])
  | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<str>'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|‘[^’]*’|“[^”]*”)
  | (?P<op>[().+&!*,=\[\]])
    )""",
    re.VERBOSE,
)


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens: list[tuple[str, str, int]] = []
        pos = 0
        while pos < len(text):
            if text[pos:].strip() == "":
                break
            m = _TOKEN.match(text, pos)
            if m is None or m.end() == pos:
                raise PolicySyntaxError(
                    f"policy {text!r}: cannot read {text[pos : pos + 12]!r} at position {pos}"
                )
            kind = m.lastgroup or "op"
            self.tokens.append((kind, m.group(kind), m.start(kind)))
            pos = m.end()
        self.i = 0

    def peek(self) -> tuple[str, str, int] | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def fail(self, expected: str) -> PolicySyntaxError:
        tok = self.peek()
        where = f"{tok[1]!r} at position {tok[2]}" if tok else "the end"
        return PolicySyntaxError(f"policy {self.text!r}: expected {expected}, found {where}")

    def eat(self, op: str) -> bool:
        tok = self.peek()
        if tok is not None and tok[0] == "op" and tok[1] == op:
            self.i += 1
            return True
        return False

    def expect(self, op: str) -> None:
        if not self.eat(op):
            raise self.fail(repr(op))

    def policy(self) -> Policy:
        out = self.conj()
        while self.eat("+"):
            out = union(out, self.conj())
        return out

    def conj(self) -> Policy:
        out = self.sequence()
        while self.eat("&"):
            out = inter(out, self.sequence())
        return out

    def sequence(self) -> Policy:
        parts = [self.unary()]
        while self.eat("."):
            parts.append(self.unary())
        out = parts[-1]
        for p in reversed(parts[:-1]):
            out = seq(p, out)
        return out

    def unary(self) -> Policy:
        if self.eat("!"):
            return neg(self.unary())
        out = self.atom()
        while self.eat("*"):
            out = star(out)
        return out

    def atom(self) -> Policy:
        tok = self.peek()
        if tok is None:
            raise self.fail("a command, 0, 1, ! or (")
        kind, text, _ = tok
        if kind == "op" and text == "(":
            self.i += 1
            out = self.policy()
            self.expect(")")
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
                        raise PolicySyntaxError(f"policy {self.text!r}: keyword {key[1]!r} given twice")
                    args[key[1]] = self.value()
                    if self.eat(")"):
                        break
                    self.expect(",")
            return Policy("cmd", cmd=Call(text, tuple(sorted(args.items()))))
        raise self.fail("a command, 0, 1, ! or (")

    def value(self) -> Value:
        tok = self.peek()
        if tok is None:
            raise self.fail("a value")
        kind, text, _ = tok
        if kind == "op" and text == "[":
            self.i += 1
            items: list[Value] = []
            if not self.eat("]"):
                while True:
                    items.append(self.value())
                    if self.eat("]"):
                        break
                    self.expect(",")
            return frozenset(items)
        self.i += 1
        if kind == "num":
            return _value(float(text))
        if kind == "str":
            body = text[1:-1]
            return re.sub(r"\\(.)", r"\1", body) if text[0] in "'\"" else body
        self.i -= 1
        raise self.fail("a number, a string or a list")


def parse(text: str) -> Policy:
    """The policy ``text`` in canonical form (module docstring); a :class:`PolicySyntaxError` names the
    position of what does not parse."""
    if not isinstance(text, str) or not text.strip():
        raise PolicySyntaxError(f"a policy must be non-empty text, not {text!r}")
    parser = _Parser(text)
    out = parser.policy()
    if parser.peek() is not None:
        raise parser.fail("an operator (+ & . *) or the end")
    return out
