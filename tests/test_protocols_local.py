"""The engine's local training: functional optimizers equal torch.optim; one client equals the vmap cohort."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fedveil.errors import ConfigError
from fedveil.models.flat import FlatModel
from fedveil.protocols.local import LocalOptimizer, local_train, local_train_cohort


def _net() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _batches(seed: int, steps: int, size: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(size, 5, generator=g), torch.randint(0, 3, (size,), generator=g)) for _ in range(steps)
    ]


def _torch_reference(opt: LocalOptimizer, batches, rates=None) -> torch.Tensor:
    net = _net()
    if opt.name == "sgd":
        o = torch.optim.SGD(net.parameters(), lr=opt.lr, momentum=opt.momentum, weight_decay=opt.weight_decay)
    else:
        o = torch.optim.Adam(
            net.parameters(), lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay
        )
    for t, (x, y) in enumerate(batches):
        if rates is not None:
            o.param_groups[0]["lr"] = rates[t]
        o.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        o.step()
    return FlatModel(net).initial()


@pytest.mark.parametrize(
    "opt",
    [
        LocalOptimizer("sgd", lr=0.1),
        LocalOptimizer("sgd", lr=0.05, momentum=0.9),
        LocalOptimizer("sgd", lr=0.05, momentum=0.5, weight_decay=1e-3),
        LocalOptimizer("adam", lr=0.01),
        LocalOptimizer("adam", lr=0.003, betas=(0.8, 0.99)),
    ],
)
def test_functional_optimizers_equal_torch_optim(opt: LocalOptimizer) -> None:
    flat = FlatModel(_net())
    batches = _batches(1, 6)

    def loss(p, x, y):
        return nn.functional.cross_entropy(flat(p, x), y)

    p, mean_loss = local_train(loss, torch.from_numpy(flat.initial()), batches, opt, opt.lr)
    torch.testing.assert_close(
        p.detach(), torch.from_numpy(_torch_reference(opt, batches)), rtol=1e-5, atol=1e-6
    )
    assert mean_loss.ndim == 0 and float(mean_loss) > 0


@settings(max_examples=10, deadline=None)
@given(
    name=st.sampled_from(["sgd", "adam"]),
    momentum=st.sampled_from([0.0, 0.9]),
    clients=st.integers(1, 4),
    steps=st.integers(1, 4),
    masked=st.booleans(),
)
def test_cohort_equals_one_by_one(name: str, momentum: float, clients: int, steps: int, masked: bool) -> None:
    flat = FlatModel(_net())
    opt = LocalOptimizer(name, lr=0.05, momentum=momentum if name == "sgd" else 0.0)
    mask = None
    if masked:
        mask = torch.zeros(flat.num_params)
        mask[: flat.sizes[0]] = 1.0

    def loss(p, x, y):
        return nn.functional.cross_entropy(flat(p, x), y)

    p0 = torch.from_numpy(flat.initial())
    starts = [p0 + 0.01 * k for k in range(clients)]
    per_client = [_batches(10 + k, steps) for k in range(clients)]
    singles = [local_train(loss, s, b, opt, opt.lr, mask) for s, b in zip(starts, per_client, strict=True)]
    stacked = [
        tuple(torch.stack([per_client[k][t][i] for k in range(clients)]) for i in range(2))
        for t in range(steps)
    ]
    p, losses = local_train_cohort(loss, torch.stack(starts), stacked, opt, opt.lr, mask)
    for k, (pk, lk) in enumerate(singles):
        torch.testing.assert_close(p[k], pk, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(losses[k], lk, rtol=1e-5, atol=1e-6)
    if mask is not None:
        frozen = mask == 0
        torch.testing.assert_close(p[:, frozen], torch.stack(starts)[:, frozen], rtol=0, atol=0)


def test_lr_decay_and_bad_settings() -> None:
    opt = LocalOptimizer(lr=0.1, lr_decay=0.01)
    assert opt.lr_at(1) == pytest.approx(0.1)
    assert opt.lr_at(101) == pytest.approx(0.05)
    for bad, match in [
        ({"name": "rmsprop"}, "rmsprop"),
        ({"lr": 0.0}, "lr 0.0"),
        ({"momentum": 1.0}, "momentum 1.0"),
        ({"momentum": -0.1}, "momentum -0.1"),
        ({"betas": (0.9, 1.0)}, "betas"),
        ({"eps": 0.0}, "eps"),
    ]:
        with pytest.raises(ConfigError, match=match):
            LocalOptimizer(**bad)
    flat = FlatModel(_net())
    with pytest.raises(ConfigError, match="at least one mini-batch"):
        local_train(lambda p, x, y: p.sum(), torch.from_numpy(flat.initial()), [], LocalOptimizer(), 0.1)


@pytest.mark.parametrize(
    "opt",
    [
        LocalOptimizer("sgd", lr=0.1),
        LocalOptimizer("sgd", lr=0.1, momentum=0.5, weight_decay=0.01),
        LocalOptimizer("adam", lr=0.01, weight_decay=0.001),
    ],
)
@pytest.mark.parametrize("masked", [False, True])
def test_inplace_steps_are_bit_identical(opt: LocalOptimizer, masked: bool) -> None:
    """The in-place step (PPFL's TEE, lighter on memory) computes exactly what the pure step does, with a
    per-step rate schedule too; the caller's vector is the one trained."""
    flat = FlatModel(_net())
    p0 = torch.from_numpy(flat.initial())
    mask = (torch.arange(flat.num_params) % 3 != 0).float() if masked else None
    batches = _batches(5, 6)
    rates = [opt.lr * 0.9**t for t in range(6)]

    def loss(p: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(flat(p, x), y)

    pure, pure_loss = local_train(loss, p0.clone(), batches, opt, rates, mask)
    owned = p0.clone()
    inplace, inplace_loss = local_train(loss, owned, batches, opt, rates, mask, inplace=True)
    assert torch.equal(pure, inplace) and torch.equal(pure_loss, inplace_loss)
    assert inplace.data_ptr() == owned.data_ptr()
    with pytest.raises(ConfigError, match="5 learning rates for 6 mini-batches"):
        local_train(loss, p0.clone(), batches, opt, rates[:5])


_OPTIMIZERS = [
    LocalOptimizer("sgd", lr=0.1),
    LocalOptimizer("sgd", lr=0.05, momentum=0.9),
    LocalOptimizer("sgd", lr=0.05, momentum=0.5, weight_decay=1e-3),
    LocalOptimizer("adam", lr=0.01),
    LocalOptimizer("adam", lr=0.003, betas=(0.8, 0.99), weight_decay=1e-3),
]


@pytest.mark.parametrize("opt", _OPTIMIZERS)
@pytest.mark.parametrize("masked", [False, True])
def test_tensor_by_tensor_steps_equal_the_flat_vector_bit_for_bit(opt: LocalOptimizer, masked: bool) -> None:
    """Given the tensors' shapes, the loss gets views into the trained vector, gradients are taken tensor by
    tensor and each tensor steps in place: the same bits as the flat vector's steps (plain and eager), the
    caller's vector trained when handed over, frozen entries untouched, and torch.optim's numbers."""
    flat = FlatModel(_net())
    p0 = torch.from_numpy(flat.initial())
    mask = (torch.arange(flat.num_params) % 3 != 0).float() if masked else None
    batches = _batches(7, 6)
    rates = [opt.lr * 0.9**t for t in range(6)]
    seen: list[tuple[torch.Tensor, ...]] = []

    def loss(p: torch.Tensor | tuple[torch.Tensor, ...], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if isinstance(p, tuple):
            seen.append(p)
        return nn.functional.cross_entropy(flat(p, x), y)

    flat_p, flat_loss = local_train(loss, p0, batches, opt, rates, mask)
    eager_p, eager_loss = local_train(loss, p0, batches, opt, rates, mask, eager=True)
    owned = p0.clone()
    p, mean_loss = local_train(loss, owned, batches, opt, rates, mask, inplace=True, shapes=flat.shapes)
    assert torch.equal(p, flat_p) and torch.equal(p, eager_p)
    assert torch.equal(mean_loss, flat_loss) and torch.equal(mean_loss, eager_loss)
    assert p.data_ptr() == owned.data_ptr() and not p.requires_grad
    assert torch.equal(p0, torch.from_numpy(flat.initial()))  # not handed over: left as it was
    assert len(seen) == len(batches)
    offsets = [0, *itertools.accumulate(flat.sizes)][:-1]
    for tensors in seen:  # views into the trained vector, one per tensor of the model, in order
        assert [t.data_ptr() for t in tensors] == [owned.data_ptr() + 4 * o for o in offsets]
        assert [tuple(t.shape) for t in tensors] == flat.shapes
    if mask is not None:
        assert torch.equal(p[mask == 0], p0[mask == 0])
    else:
        reference = torch.from_numpy(_torch_reference(opt, batches, rates))
        torch.testing.assert_close(p, reference, rtol=1e-5, atol=1e-6)


def test_a_gradient_two_tensors_share_and_a_tensor_the_loss_skips_step_as_in_the_flat_vector() -> None:
    """Autograd hands the same gradient to two tensors added together (the step overwrites its gradient,
    so each must get its own), and none to a tensor the loss does not use (a zero gradient, which weight
    decay and momentum still step): both as the flat vector's gradient has them."""
    shapes = [(4,), (4,), (3,)]
    opt = LocalOptimizer("sgd", lr=0.1, momentum=0.9, weight_decay=0.01)
    p0 = torch.linspace(-1.0, 1.0, 11)
    batches = _batches(2, 4)

    def loss(p: torch.Tensor | tuple[torch.Tensor, ...], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        a, b, _unused = p if isinstance(p, tuple) else torch.split(p, [4, 4, 3])
        return ((x[:, :4] * (a + b)).sum(dim=1) - y).pow(2).mean()

    flat_p, flat_loss = local_train(loss, p0, batches, opt, opt.lr)
    p, mean_loss = local_train(loss, p0, batches, opt, opt.lr, shapes=shapes)
    assert torch.equal(p, flat_p) and torch.equal(mean_loss, flat_loss)
    assert not torch.equal(p[8:], p0[8:])  # weight decay moved the unused tensor
    with pytest.raises(ConfigError, match="tensor shapes of 12 entries in all for a vector of 11"):
        local_train(loss, p0, batches, opt, opt.lr, shapes=[(4,), (4,), (4,)])


def test_the_cohort_trains_a_handed_over_matrix_in_place() -> None:
    flat = FlatModel(_net())
    opt = LocalOptimizer("adam", lr=0.01)

    def loss(p: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(flat(p, x), y)

    starts = torch.stack([torch.from_numpy(flat.initial()) + 0.01 * k for k in range(3)])
    per_client = [_batches(20 + k, 3) for k in range(3)]
    stacked = [
        tuple(torch.stack([per_client[k][t][i] for k in range(3)]) for i in range(2)) for t in range(3)
    ]
    copied, copied_losses = local_train_cohort(loss, starts, stacked, opt, opt.lr)
    owned = starts.clone()
    p, losses = local_train_cohort(loss, owned, stacked, opt, opt.lr, inplace=True)
    assert p.data_ptr() == owned.data_ptr() and not torch.equal(owned, starts)
    assert torch.equal(p, copied) and torch.equal(losses, copied_losses)


@pytest.mark.parametrize("eager", [False, True])
def test_a_loss_whose_gradient_is_a_broadcast_still_steps(eager: bool) -> None:
    """``p.sum() * c`` has the gradient ``c`` broadcast over ``p`` (one value, not a vector): the in-place
    step still applies it, to every entry."""
    p0 = torch.zeros(5)
    batches = [(torch.tensor([2.0]),), (torch.tensor([4.0]),)]
    p, mean_loss = local_train(
        lambda p, c: p.sum() * c[0], p0, batches, LocalOptimizer(lr=0.5), 0.5, eager=eager
    )
    assert torch.equal(p, torch.full((5,), -3.0)) and float(mean_loss) == -10.0
