"""PoliFL's policy language (Policy-Based Federated Learning, Sec. 3.3, Table 3, Appendix A): the
paper's policies parse as written and print back, E and D against an independent span-based matcher on
random policies and command sequences (negation and intersection included), a policy advanced through
6,000 accumulations stays small, and the limits: nesting, length and size beyond them are a
PolicySyntaxError naming the limit, deep nesting and long sequences within them work without
recursion, and parsed policies are kept."""

from __future__ import annotations

import random
from functools import cache

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fedveil.errors import ConfigError
from fedveil.privacy import policy as policy_module
from fedveil.privacy.pairs import next_commands
from fedveil.privacy.policy import (
    ANY,
    MAX_POLICY_DEPTH,
    ONE,
    ZERO,
    Call,
    Policy,
    PolicySyntaxError,
    advance,
    allows,
    budget_of,
    command,
    derivative,
    inter,
    matches,
    neg,
    nullable,
    parse,
    seq,
    show,
    size,
    star,
    union,
)

PAPER = [
    "get_data . runFL . return",
    "get_data . train_local. accumulate* . (train_local . accumulate* + average*) . return",
    "get_data . runFL . enforce_dp_budget(eps=1) . return",
    "get_data . train_local_dp. accumulate* . (train_local_dp . accumulate* + average*) . "
    "enforce_dp_budget(eps=1) . return",
    "get_data . filter(sensors=[‘mic’, ‘loc’]) . runFL . return",
    'get_data(data_type="reddit").runFL.enforce_privacy_budget(max_eps=1).return',
    'get_data(data_type="reddit").runFL.enforce_privacy_budget(max_eps=2).return',
    'get_data(data_type="cifar").runFL.check_privacy_budget(max_eps=2).return',
    'get_data(data_type="cifar").runFL.check_privacy_budget(max_eps=5).return',
    'get_data(data_type="MPU").runFL.return',
    "get_data(data_type=\"MPU\").filter(sensors=['mic', 'loc']).runFL.return",
]


def c(name: str, **args: object) -> Call:
    return Call.of(name, args)


@pytest.mark.parametrize("text", PAPER)
def test_the_papers_policies_parse_as_written_and_round_trip(text: str) -> None:
    p = parse(text)
    assert parse(show(p)) == p


def test_the_fl_policy_allows_federated_training_and_nothing_else() -> None:
    p = parse(PAPER[1])
    ok = ["get_data", "train_local", "accumulate", "accumulate", "average", "average", "return"]
    assert allows(p, [c(n) for n in ok])
    assert not allows(p, [c("get_data"), c("return")])
    assert not allows(p, [c("train_local"), c("get_data")])
    assert advance(p, [c("get_data"), c("return")]) == ZERO


def test_argument_matching_rules() -> None:
    """Named keywords must be equal (lists as sets, numbers as numbers); others are free."""
    f = parse("filter(sensors=['mic', 'loc'])").cmd
    assert f is not None
    assert matches(f, c("filter", sensors=["loc", "mic"], extra="x"))
    assert not matches(f, c("filter", sensors=["mic"]))
    assert not matches(f, c("filter"))
    budget = parse("enforce_dp_budget(eps=1)").cmd
    assert budget is not None
    assert matches(budget, c("enforce_dp_budget", eps=1.0))
    assert matches(budget, c("enforce_dp_budget", eps=0.5)), "a tighter budget also enforces eps=1"
    assert not matches(budget, c("enforce_dp_budget", eps=2))
    assert not matches(budget, c("enforce_dp_budget", epsilon=0.5)), "only the budget keyword is a bound"
    both = parse("check_privacy_budget(max_eps=2) . return & check_privacy_budget(max_eps=5) . return")
    assert allows(both, [c("check_privacy_budget", max_eps=2), c("return")])
    assert not allows(both, [c("check_privacy_budget", max_eps=3), c("return")])
    assert budget_of(both) == 2.0 and budget_of(parse("get_data . runFL . return")) is None
    anyget = parse("get_data").cmd
    assert anyget is not None and matches(anyget, c("get_data", data_type="reddit"))


def test_reductions() -> None:
    a, b = command("a"), command("b")
    assert seq(ZERO, a) == ZERO and seq(a, ZERO) == ZERO and seq(ONE, a) == a and seq(a, ONE) == a
    assert union(a, ZERO) == a and union(a, a) == a and union(a, ANY) == ANY
    assert union(union(a, b), a) == union(b, a)
    assert inter(a, ZERO) == ZERO and inter(a, ANY) == a and inter(a, a) == a
    assert star(star(a)) == star(a) and star(ZERO) == ONE and neg(neg(a)) == a
    assert union(ONE, star(a)) == star(a)
    assert parse("(a . b) . c") == parse("a . (b . c)")


def test_syntax_errors_name_the_position() -> None:
    with pytest.raises(PolicySyntaxError, match=r"expected '\)', found the end"):
        parse("(a . b")
    with pytest.raises(
        PolicySyntaxError, match="expected a command, 0, 1, ! or \\(, found '\\+' at position 4"
    ):
        parse("a . + b")
    with pytest.raises(PolicySyntaxError, match="keyword 'x' given twice"):
        parse("f(x=1, x=2)")
    with pytest.raises(PolicySyntaxError, match="cannot read"):
        parse("a . $b")
    with pytest.raises(PolicySyntaxError, match="non-empty"):
        parse("  ")


def test_size_stays_bounded_over_6000_accumulations() -> None:
    """Sec. 3.3's FL policy; each accumulation intersects the running sum's policy with the new local
    model's (accumulate combines two pairs) and advances it: the canonical sets keep it small."""
    p = parse(PAPER[1])
    local = advance(p, [c("get_data"), c("train_local")])
    running = local
    sizes = []
    for _ in range(6000):
        running = derivative(inter(running, local), c("accumulate"))
        sizes.append(size(running))
    assert running != ZERO and max(sizes) <= size(local) + 4
    for _ in range(100):
        running = derivative(running, c("average"))
    assert nullable(derivative(running, c("return")))


# --- an independent reference: which spans of a word a policy matches -----------------------------------


def _ends(p: Policy, word: tuple[Call, ...], i: int) -> frozenset[int]:
    @cache
    def go(q: Policy, start: int) -> frozenset[int]:
        if q.kind == "zero":
            return frozenset()
        if q.kind == "one":
            return frozenset({start})
        if q.kind == "cmd":
            assert q.cmd is not None
            return (
                frozenset({start + 1}) if start < len(word) and matches(q.cmd, word[start]) else frozenset()
            )
        if q.kind == "seq":
            return frozenset(e for m in go(q.parts[0], start) for e in go(q.parts[1], m))
        if q.kind == "or":
            return frozenset().union(*(go(r, start) for r in q.parts))
        if q.kind == "and":
            out = go(q.parts[0], start)
            for r in q.parts[1:]:
                out &= go(r, start)
            return out
        if q.kind == "not":
            return frozenset(range(start, len(word) + 1)) - go(q.parts[0], start)
        reach, todo = {start}, [start]
        while todo:
            for e in go(q.parts[0], todo.pop()):
                if e not in reach:
                    reach.add(e)
                    todo.append(e)
        return frozenset(reach)

    return go(p, i)


CALLS = [c("a"), c("b"), c("f", x=1), c("f", x=2)]
ATOMS = st.sampled_from([ZERO, ONE, command("a"), command("b"), command("f", {"x": 1}), command("f")])
POLICIES = st.recursive(
    ATOMS,
    lambda kids: st.one_of(
        st.builds(seq, kids, kids),
        st.builds(union, kids, kids),
        st.builds(inter, kids, kids),
        st.builds(neg, kids),
        st.builds(star, kids),
    ),
    max_leaves=8,
)


@settings(max_examples=400, deadline=None)
@given(POLICIES, st.lists(st.sampled_from(CALLS), max_size=6))
def test_derivatives_agree_with_the_span_matcher(p: Policy, word: list[Call]) -> None:
    assert allows(p, word) == (len(word) in _ends(p, tuple(word), 0))
    assert parse(show(p)) == p


def test_emptiness() -> None:
    from fedveil.privacy.policy import is_empty

    assert is_empty(parse("a & b")) and is_empty(parse("a & !a")) and is_empty(ZERO)
    assert not is_empty(parse("a* & !1")) and not is_empty(parse("!a")) and not is_empty(ONE)
    assert is_empty(parse("(a . b)* . a & (a . b)*"))


@settings(max_examples=300, deadline=None)
@given(POLICIES)
def test_an_empty_policy_accepts_no_short_word(p: Policy) -> None:
    """Soundness of is_empty against the span matcher on every word of up to 3 calls."""
    from itertools import product

    from fedveil.privacy.policy import is_empty

    if is_empty(p):
        for n in range(4):
            for word in product(CALLS, repeat=n):
                assert n not in _ends(p, word, 0)


def test_cli_policy_check(capsys: pytest.CaptureFixture[str]) -> None:
    from fedveil.cli import main

    fl = "get_data . filter(sensors=['mic','loc']) . runFL . return"
    assert main(["policy", "check", fl, "get_data", "filter(sensors=['loc','mic'])", "runFL", "return"]) == 0
    assert "complete: the sequence may end here" in capsys.readouterr().out
    assert main(["policy", "check", fl, "get_data", "runFL", "--json"]) == 1
    import json

    report = json.loads(capsys.readouterr().out)
    assert report["steps"][-1] == {
        "command": "runFL",
        "allowed": False,
        "would_accept": ["filter(sensors=['loc', 'mic'])"],
    }
    assert main(["policy", "check", "get_data . (", "x"]) == 2
    assert main(["policy", "check", fl, "a . b"]) == 2


# --- limits: nesting, length and size refused by name; within them, no recursion ---------------------------


@pytest.mark.parametrize(
    "text",
    [
        "(" * 5000 + "a" + ")" * 5000,
        "!" * 5000 + "a",
        "(!" * 3000 + "a" + ")" * 3000,
        "f(x=" + "[" * 3000 + "1" + "]" * 3000 + ")",
        "a . (" * (MAX_POLICY_DEPTH + 1) + "b" + ")" * (MAX_POLICY_DEPTH + 1),
    ],
    ids=["parentheses", "negations", "mixed", "lists", "one-over"],
)
def test_nesting_beyond_the_limit_is_a_syntax_error_naming_it(text: str) -> None:
    with pytest.raises(PolicySyntaxError, match=rf"deeper than the limit of {MAX_POLICY_DEPTH} levels"):
        parse(text)


def test_nesting_at_the_limit_parses() -> None:
    depth = MAX_POLICY_DEPTH
    assert parse("(" * depth + "a . b" + ")" * depth) == parse("a . b")
    assert parse("!" * depth + "a") == parse("a")
    assert parse("f(x=" + "[" * depth + "1" + "]" * depth + ")").cmd is not None


def test_length_and_size_beyond_the_limits_are_syntax_errors_naming_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(policy_module, "MAX_POLICY_CHARS", 20)
    monkeypatch.setattr(policy_module, "MAX_POLICY_NODES", 5)
    with pytest.raises(PolicySyntaxError, match="longer than the limit of 20 characters"):
        parse("more_than . twenty_characters")
    with pytest.raises(PolicySyntaxError, match="has 7 nodes, over the limit of 5"):
        parse("n1 . n2 . n3 . n4")
    assert size(parse("n1 . n2 . n3")) == 5


def test_a_nested_call_value_beyond_the_limit_is_refused_by_name() -> None:
    deep: list[object] = [1.0]
    for _ in range(3000):
        deep = [deep]
    with pytest.raises(ConfigError, match=rf"deeper than the limit of {MAX_POLICY_DEPTH} levels"):
        Call.of("f", {"x": deep})


def test_cli_refuses_a_deeply_nested_policy_with_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from fedveil.cli import main

    assert main(["policy", "check", "(" * 5000 + "a" + ")" * 5000, "a"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"the limit of {MAX_POLICY_DEPTH} levels" in err and len(err) < 400


# semantics-preserving wrappers and the nesting levels each adds ('!' and '(' count one each)
WRAPPERS = [("({})", 1), ("!(!({}))", 4), ("({} . 1)", 1), ("(1 . {})", 1), ("({} + 0)", 1), ("({} & !0)", 1)]


def _wrapped(p: Policy, picks: list[int], depth: int) -> str:
    """``show(p)`` in wrappers (picked in turn from ``picks``) until ``depth`` levels of nesting (what
    ``show(p)`` itself nests is at most its count of ``(``, ``[`` and ``!``)."""
    text = show(p)
    text, level = f"({text})", 1 + sum(text.count(ch) for ch in "([!")
    for i in range(10 * depth):
        form, cost = WRAPPERS[picks[i % len(picks)]]
        if level + cost > depth:
            break
        text, level = form.format(text), level + cost
    return text


@settings(max_examples=60, deadline=None)
@given(
    POLICIES,
    st.lists(st.integers(0, len(WRAPPERS) - 1), min_size=1, max_size=8),
    st.integers(1, MAX_POLICY_DEPTH),
    st.lists(st.sampled_from(CALLS), max_size=5),
)
def test_deep_nesting_within_the_limit_keeps_the_meaning(
    p: Policy, picks: list[int], depth: int, word: list[Call]
) -> None:
    q = parse(_wrapped(p, picks, depth))
    assert q == p
    assert allows(q, word) == (len(word) in _ends(p, tuple(word), 0))


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, len(WRAPPERS) - 1), min_size=1, max_size=8), st.integers(1, 3000))
def test_nesting_beyond_the_limit_is_never_a_recursion_error(picks: list[int], extra: int) -> None:
    with pytest.raises(PolicySyntaxError, match="deeper than the limit"):
        parse(
            "(" * (MAX_POLICY_DEPTH + extra)
            + _wrapped(command("a"), picks, 10)
            + ")" * (MAX_POLICY_DEPTH + extra)
        )


SEQ_COMMANDS = ["a", "b", "f(x=1)", "f(x=[1, 2])", "g(y='z')"]
SEQ_CALLS = [c("a"), c("b"), c("f", x=1), c("f", x=[2, 1]), c("g", y="z"), c("f", x=2)]


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(0, len(SEQ_COMMANDS) - 1), min_size=1, max_size=40),
    st.integers(1, 75),
    st.integers(0, 2**32 - 1),
)
@example(picks=[0, 1, 2, 3, 4] * 8, repeat=75, seed=0)  # 3,000 commands
def test_long_sequences_parse_print_and_advance_without_recursion(
    picks: list[int], repeat: int, seed: int
) -> None:
    """Up to 3,000 commands in a sequence: the word itself is allowed, a word with one call changed to
    one the command does not match is refused (the reference: a sequence of commands allows exactly the
    words whose calls match it in turn)."""
    order = picks * repeat
    p = parse(" . ".join(SEQ_COMMANDS[i] for i in order))
    assert parse(show(p)) == p and size(p) == 2 * len(order) - 1
    word = [SEQ_CALLS[i] for i in order]
    assert allows(p, word) and not allows(p, word[:-1]) and not allows(p, [*word, c("a")])
    rng = random.Random(seed)
    at = rng.randrange(len(word))
    other = rng.choice(SEQ_CALLS)
    changed = [*word[:at], other, *word[at + 1 :]]
    expected = all(matches(q.cmd, call) for q, call in zip(_commands_of(p), changed, strict=True))
    assert allows(p, changed) == expected
    assert next_commands(p) == [show(parse(SEQ_COMMANDS[order[0]]))]


def _commands_of(p: Policy) -> list[Policy]:
    out = []
    while p.kind == "seq":
        out.append(p.parts[0])
        p = p.parts[1]
    return [*out, p]


@settings(max_examples=20, deadline=None)
@given(st.lists(st.integers(0, 2), min_size=1, max_size=200), st.integers(0, 2**32 - 1))
def test_a_long_sequence_of_stars_accepts_its_subsequences(picks: list[int], seed: int) -> None:
    """``c1* . c2* . ... . cn*`` (every head nullable, the derivative a union along the whole sequence)
    allows every subsequence of ``c1 ... cn`` and nothing with a command it does not name."""
    names = ["a", "b", "f(x=1)"]
    p = parse(" . ".join(f"{names[i]}*" for i in picks))
    rng = random.Random(seed)
    word = [SEQ_CALLS[i] for i in picks if rng.random() < 0.2]
    assert allows(p, word)
    assert not allows(p, [*word, c("g", y="z")])
    assert nullable(p) and parse(show(p)) == p


def test_later_stages_do_not_recurse_on_deep_policies() -> None:
    """Policies deeper than any parse allows, built with the constructors (as derivatives build them)
    or as plain nodes: equality, hashing, printing, E, D, sizes, budgets and the refusal's hint work
    with stacks."""
    deep = command("z")
    for i in range(5000):
        deep = union(command(f"c{i % 5}"), seq(command("a"), neg(neg(deep))))
    assert len(show(deep)) > 5000 and size(deep) == 4 * 5000 + 1 and not nullable(deep)
    assert allows(deep, [c("a")] * 5000 + [c("z")]) and allows(deep, [c("c4")])
    assert not allows(deep, [c("a")] * 4999 + [c("z")])
    assert budget_of(deep) is None and next_commands(deep) == ["a", "c4"]

    def plain() -> Policy:
        out = Policy("cmd", cmd=Call.of("z"))
        for i in range(5000):
            out = Policy("not", (out,)) if i % 2 else Policy("seq", (Policy("cmd", cmd=Call.of("a")), out))
        return out

    one, other = plain(), plain()
    assert one is not other and one == other and hash(one) == hash(other) and one != deep
    assert show(one).startswith("!(a . !(a . ") and nullable(one)


def test_parsed_policies_are_kept_and_the_kept_ones_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A text parsed once is not parsed again (a service reads stored policies on every request); the
    least recently used goes when more are kept than allowed."""
    parsed: list[str] = []

    class Counting(policy_module._Parser):
        def __init__(self, text: str) -> None:
            parsed.append(text)
            super().__init__(text)

    monkeypatch.setattr(policy_module, "_Parser", Counting)
    monkeypatch.setattr(policy_module, "PARSED_KEPT", 2)
    policy_module.forget_parsed()
    t0, t1, t2 = "kept_a . b", "kept_b . c", "kept_c . d"
    for text in [t0, t0, t1, t2, t2, t1, t0]:
        assert show(parse(text)) == text
    assert parsed == [t0, t1, t2, t0]
