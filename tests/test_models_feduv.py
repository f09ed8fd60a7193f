"""FedUV's Table 2 networks, the Scaling layer and the positive-only loss ([FedUV])."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fedveil.errors import ConfigError, ValidationError
from fedveil.models.feduv import (
    EMBEDDING_DIM,
    UV_NETS,
    CelebANet,
    MnistUvNet,
    Scaling,
    UvNet,
    VoxCelebNet,
    build_uv_net,
    feduv_positive_loss,
    feduv_scores,
)

PROPERTY = settings(max_examples=60, deadline=None)

# Table 2 read layer by layer: (conv in, conv out, kernel, padding, pool) per block; GN(2) after each.
TABLE_2 = {
    VoxCelebNet: [
        (1, 64, 15, 1, 4),
        (64, 128, 9, 1, 8),
        (128, 256, 7, 1, 8),
        (256, 512, 5, 1, 8),
        (512, 1024, 3, 1, 8),
    ],
    CelebANet: [
        (3, 64, 3, 1, 2),
        (64, 128, 3, 1, 2),
        (128, 256, 3, 1, 2),
        (256, 512, 3, 1, 2),
        (512, 1024, 3, 1, 4),
    ],
    MnistUvNet: [
        (4, 64, 3, 3, 2),
        (64, 128, 3, 1, 2),
        (128, 256, 3, 1, 2),
        (256, 512, 3, 1, 2),
        (512, 1024, 3, 1, 2),
    ],
}

# Feature-map shape after each block for the paper's inputs (module docstring).
BLOCK_SHAPES = {
    VoxCelebNet: [(64, 4093), (128, 511), (256, 64), (512, 8), (1024, 1)],
    CelebANet: [(64, 32, 32), (128, 16, 16), (256, 8, 8), (512, 4, 4), (1024, 1, 1)],
    MnistUvNet: [(64, 16, 16), (128, 8, 8), (256, 4, 4), (512, 2, 2), (1024, 1, 1)],
}

# Documented parameter counts of g_theta (convolutions with bias + GroupNorm affine).
FEATURE_PARAMETERS = {VoxCelebNet: 2_538_240, CelebANet: 6_274_560, MnistUvNet: 6_275_136}


def analytic_parameters(blocks: list[tuple[int, int, int, int, int]], spatial_dims: int) -> int:
    conv = sum(c_in * c_out * k**spatial_dims + c_out for c_in, c_out, k, _, _ in blocks)
    group_norm = sum(2 * c_out for _, c_out, _, _, _ in blocks)
    return conv + group_norm


@pytest.mark.parametrize("net_cls", list(TABLE_2))
def test_layers_follow_table_2(net_cls: type[UvNet]) -> None:
    net = net_cls(127, scaling=True)
    layers = list(net.features)
    assert len(layers) == 5 * 4 + 1 and isinstance(layers[-1], nn.Flatten)
    for i, (c_in, c_out, kernel, padding, pool) in enumerate(TABLE_2[net_cls]):
        conv, relu, pooling, norm = layers[4 * i : 4 * i + 4]
        dims = 1 if net_cls is VoxCelebNet else 2
        assert isinstance(conv, nn.Conv1d if dims == 1 else nn.Conv2d)
        assert (conv.in_channels, conv.out_channels) == (c_in, c_out)
        assert conv.kernel_size == (kernel,) * dims and conv.padding == (padding,) * dims
        assert conv.stride == (1,) * dims and conv.bias is not None
        assert isinstance(relu, nn.ReLU)
        assert isinstance(pooling, nn.MaxPool1d if dims == 1 else nn.MaxPool2d)
        assert pooling.kernel_size == pool and pooling.stride == pool
        assert isinstance(norm, nn.GroupNorm) and (norm.num_groups, norm.num_channels) == (2, c_out)
    assert (net.fc.in_features, net.fc.out_features) == (EMBEDDING_DIM, 127)
    assert isinstance(net.scale, Scaling)


@pytest.mark.parametrize("net_cls", list(TABLE_2))
def test_feature_maps_for_paper_input_sizes(net_cls: type[UvNet]) -> None:
    net = net_cls(10, scaling=False).eval()
    x = torch.randn(2, *net_cls.input_shape)
    shapes = []
    h = x
    with torch.no_grad():
        for layer in net.features:
            h = layer(h)
            if isinstance(layer, nn.GroupNorm):
                shapes.append(tuple(h.shape[1:]))
        assert shapes == BLOCK_SHAPES[net_cls]
        assert net.embed(x).shape == (2, EMBEDDING_DIM)
        assert net(x).shape == (2, 10)


def test_paper_input_shapes() -> None:
    assert VoxCelebNet.input_shape == (1, 2**14)
    assert CelebANet.input_shape == (3, 64, 64)
    assert MnistUvNet.input_shape == (4, 28, 28)


@pytest.mark.parametrize("net_cls", list(TABLE_2))
def test_parameter_counts_are_documented(net_cls: type[UvNet]) -> None:
    net = net_cls(255, scaling=True)
    features = sum(p.numel() for p in net.features.parameters())
    dims = 1 if net_cls is VoxCelebNet else 2
    assert features == FEATURE_PARAMETERS[net_cls] == analytic_parameters(TABLE_2[net_cls], dims)
    assert f"{FEATURE_PARAMETERS[net_cls]:,}" in (net_cls.__doc__ or "")
    assert sum(p.numel() for p in net.fc.parameters()) == 1025 * 255
    assert sum(p.numel() for p in net_cls(255, scaling=True, bias=False).fc.parameters()) == 1024 * 255


@pytest.mark.parametrize(("net_cls", "c"), [(MnistUvNet, 127), (CelebANet, 255), (VoxCelebNet, 511)])
def test_feduv_outputs_have_norm_sqrt_c(net_cls: type[UvNet], c: int) -> None:
    torch.manual_seed(0)
    net = net_cls(c, scaling=True).eval()
    with torch.no_grad():
        out = net(torch.randn(3, *net_cls.input_shape))
    assert out.shape == (3, c)
    assert torch.allclose(out.norm(dim=1), torch.full((3,), math.sqrt(c)), rtol=1e-5)


def test_softmax_and_fedaws_heads_have_one_output_per_user() -> None:
    net = build_uv_net("mnist_uv", 1000, scaling=False)
    assert isinstance(net, MnistUvNet) and isinstance(net.scale, nn.Identity)
    assert net.num_outputs == 1000 and net.fc.weight.shape == (1000, EMBEDDING_DIM)
    assert {name: type(build_uv_net(name, 7, scaling=True)) for name in UV_NETS} == UV_NETS


def test_bad_network_settings_are_rejected() -> None:
    with pytest.raises(ConfigError, match=r"no Table 2 network for dataset 'mnist'.*'mnist_uv'"):
        build_uv_net("mnist", 127, scaling=True)
    with pytest.raises(ConfigError, match=r"num_outputs .* positive integer, not 0"):
        MnistUvNet(0, scaling=True)


# ---- Scaling -------------------------------------------------------------------------------------------


@PROPERTY
@given(
    st.lists(st.floats(-1e3, 1e3, allow_nan=False, width=32), min_size=1, max_size=64).filter(
        lambda v: sum(x * x for x in v) > 1e-6
    )
)
def test_scaling_gives_norm_sqrt_c_and_keeps_direction(values: list[float]) -> None:
    z = torch.tensor([values, [2 * v for v in values]], dtype=torch.float64)
    out = Scaling()(z)
    c = len(values)
    assert torch.allclose(out.norm(dim=1), torch.full((2,), math.sqrt(c), dtype=torch.float64))
    assert torch.allclose(out[0], out[1])
    assert torch.allclose(out[0] * z[0].norm(), z[0] * math.sqrt(c))


def test_scaling_of_zero_stays_finite() -> None:
    out = Scaling()(torch.zeros(2, 5))
    assert torch.equal(out, torch.zeros(2, 5))


def test_scaling_hand_made_vector() -> None:
    out = Scaling()(torch.tensor([[3.0, 4.0, 0.0, 0.0]]))
    assert torch.allclose(out, torch.tensor([[1.2, 1.6, 0.0, 0.0]]))


# ---- positive loss -----------------------------------------------------------------------------------


def test_positive_loss_hand_made_vectors() -> None:
    v = torch.tensor([1.0, -1.0, 1.0, -1.0])
    orthogonal = torch.tensor([1.0, 1.0, 1.0, 1.0])
    half = torch.tensor([1.0, -1.0, 1.0, 1.0])  # score 1/2
    assert feduv_positive_loss(v[None], v).item() == 0.0  # Lemma 1: z = v_y
    assert feduv_positive_loss(-v[None], v).item() == 2.0
    assert feduv_positive_loss(orthogonal[None], v).item() == 1.0
    assert feduv_positive_loss(half[None], v).item() == 0.5
    batch = torch.stack([v, -v, orthogonal, half])
    assert feduv_positive_loss(batch, v).item() == pytest.approx((0 + 2 + 1 + 0.5) / 4)
    assert feduv_scores(batch, v).tolist() == [1.0, -1.0, 0.0, 0.5]
    per_row = torch.stack([v, -v])
    assert feduv_positive_loss(torch.stack([v, v]), per_row).item() == 1.0  # row-wise codewords


@PROPERTY
@given(st.integers(2, 32), st.integers(0, 2**31 - 1))
def test_positive_loss_is_zero_only_at_the_codeword(c: int, seed: int) -> None:
    """Lemma 1: with ||z|| = sqrt(c), l_pos is in [0, 2] and 0 iff z = v_y."""
    gen = torch.Generator().manual_seed(seed)
    v = torch.where(torch.rand(c, generator=gen) < 0.5, -1.0, 1.0).double()
    z = Scaling()(torch.randn(4, c, generator=gen, dtype=torch.float64))
    per_example = torch.stack([feduv_positive_loss(z[i : i + 1], v) for i in range(4)])
    assert ((per_example >= 0) & (per_example <= 2 + 1e-12)).all()
    assert torch.allclose(per_example, torch.relu(1 - z @ v / c))
    assert (per_example > 0).all()  # a random direction is never exactly v_y
    assert feduv_positive_loss(v[None], v).item() == 0.0


def test_positive_loss_trains_the_net_towards_the_codeword() -> None:
    torch.manual_seed(0)
    net = MnistUvNet(15, scaling=True)
    x = torch.randn(2, *MnistUvNet.input_shape)
    v = torch.tensor([1.0, -1.0] * 7 + [1.0])
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = feduv_positive_loss(net(x), v)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(p.grad is not None for p in net.parameters())
    assert losses[-1] < losses[0]


def test_loss_shape_mismatch_is_rejected() -> None:
    with pytest.raises(ValidationError, match=r"codewords must have shape \(4,\) or \(2, 4\).*not \(5,\)"):
        feduv_positive_loss(torch.zeros(2, 4), torch.ones(5))
    with pytest.raises(ValidationError, match=r"outputs must have shape \(B, c\), not \(4,\)"):
        feduv_scores(torch.zeros(4), torch.ones(4))
