"""Data-policy pairs (PoliFL Sec. 3.3): commands advance the policy, combined pairs intersect their
policies, the wrong side is refused, and no refusal or repr shows the value."""

from __future__ import annotations

import copy
import pickle

import pytest

from fedveil.privacy.pairs import DataPolicyPair, PolicyViolation, Side, apply, next_commands, release
from fedveil.privacy.policy import parse, show

FL = "get_data . train_local . accumulate* . (train_local . accumulate* + average*) . return"
SECRET = "4242-secret-value"


def _data() -> DataPolicyPair:
    return DataPolicyPair(
        {"mic": SECRET, "loc": [51.5, -0.1], "acc": [0.1]},
        parse("get_data . filter(sensors=['mic', 'loc']) . runFL . return"),
    )


def test_commands_advance_the_policy_and_release_ends_it() -> None:
    pair = apply("get_data", [_data()], lambda v: v, side=Side.DEVICE)
    pair = apply(
        "filter",
        [pair],
        lambda v: {k: x for k, x in v.items() if k not in ("mic", "loc")},
        side=Side.DEVICE,
        args={"sensors": ["loc", "mic"]},
    )
    pair = apply("runFL", [pair], lambda v: sorted(v), side=Side.SERVER)
    assert show(pair.policy) == "return"
    assert release(pair) == ["acc"]


def test_refusals_name_the_command_and_what_was_allowed_never_the_value() -> None:
    pair = apply("get_data", [_data()], lambda v: v, side=Side.DEVICE)
    with pytest.raises(PolicyViolation) as info:
        apply("runFL", [pair], lambda v: v, side=Side.SERVER)
    message = str(info.value)
    assert "runFL is not allowed" in message and "would accept: filter(sensors=['loc', 'mic'])" in message
    assert SECRET not in message and SECRET not in repr(pair)
    with pytest.raises(PolicyViolation, match="filter\\(sensors=\\['mic'\\]\\) is not allowed"):
        apply("filter", [pair], lambda v: v, side=Side.DEVICE, args={"sensors": ["mic"]})
    filtered = apply("filter", [pair], lambda v: v, side=Side.DEVICE, args={"sensors": ["mic", "loc"]})
    with pytest.raises(PolicyViolation, match=r"return is not allowed by the policy 'runFL \. return'"):
        release(filtered)
    with pytest.raises(PolicyViolation, match=r"return does not end the policy .*; still required: release"):
        release(DataPolicyPair(SECRET, parse("return . release")))


def test_device_commands_are_refused_on_the_server_and_vice_versa() -> None:
    pair = DataPolicyPair(1, parse(FL))
    with pytest.raises(PolicyViolation, match="get_data runs on the device, not on the server"):
        apply("get_data", [pair], lambda v: v, side=Side.SERVER)
    with pytest.raises(PolicyViolation, match="accumulate runs on the server, not on the device"):
        apply("accumulate", [pair], lambda v: v, side=Side.DEVICE)
    with pytest.raises(PolicyViolation, match="not a command of the trusted library"):
        apply("os_system", [pair], lambda v: v, side=Side.DEVICE)


def test_combining_pairs_intersects_their_policies() -> None:
    """train_local(model, data): the result carries P_model & P_data, both advanced (Sec. 3.3)."""
    model = DataPolicyPair(0.0, parse("train_local . (accumulate + average)* . return"))
    data = apply("get_data", [DataPolicyPair(1.0, parse(FL))], lambda v: v, side=Side.DEVICE)
    local = apply("train_local", [model, data], lambda m, d: m + d, side=Side.DEVICE)
    assert local.policy.kind == "and"
    summed = apply("accumulate", [local, local], lambda a, b: a + b, side=Side.SERVER)
    with pytest.raises(PolicyViolation, match="get_data is not allowed"):
        apply("get_data", [summed], lambda v: v, side=Side.DEVICE)
    assert release(apply("average", [summed], lambda v: v / 2, side=Side.SERVER)) == 1.0
    strict = DataPolicyPair(0.0, parse("train_local . return"))
    with pytest.raises(PolicyViolation, match="allow no common continuation"):
        apply(
            "train_local",
            [strict, DataPolicyPair(1.0, parse("train_local . accumulate"))],
            max,
            side=Side.DEVICE,
        )


def test_a_pair_cannot_be_serialised_or_copied_to_reach_its_value() -> None:
    pair = _data()
    with pytest.raises(TypeError, match="cannot be serialised"):
        pickle.dumps(pair)
    with pytest.raises(TypeError):
        copy.copy(pair)
    assert not hasattr(pair, "value") and pair != DataPolicyPair(pair, pair.policy)
    assert next_commands(parse("a* . b + !c")) == ["a", "anything but c", "b"]
