"""PoliFL's policy language (003_d27972a5478cff69.txt, Sec. 3.3, Table 3, Appendix A): the paper's
policies parse as written and print back, E and D against an independent span-based matcher on random
policies and command sequences (negation and intersection included), and a policy advanced through
6,000 accumulations stays small."""

from __future__ import annotations

from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedveil.privacy.policy import (
    ANY,
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
