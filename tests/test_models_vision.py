"""The model zoo: PPFL's Table 1 networks (Sec. 5.2) and DLG's sigmoid LeNet."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from torch import nn

from fedveil.errors import ConfigError
from fedveil.models.vision import (
    MOBILENETV2_SETTINGS,
    LayerwiseNet,
    LeNetSigmoid,
    MobileNetV2,
    dlg_uniform_init_,
)
from fedveil.models.zoo import MODELS, build_model, count_parameters

NAMES = ["lenet", "alexnet", "vgg9", "vgg16", "mobilenetv2", "lenet-sigmoid"]
INPUTS = [(1, 28), (3, 32)]  # (in_channels, image_size): MNIST / Fashion-MNIST and CIFAR-10


def conv(k: int, c_in: int, c_out: int, bias: bool = True) -> int:
    """Parameters of a dense ``k x k`` convolution: ``k*k*c_in*c_out (+ c_out)``."""
    return k * k * c_in * c_out + (c_out if bias else 0)


def fc(n_in: int, n_out: int) -> int:
    """Parameters of a fully connected layer: ``in*out + out``."""
    return n_in * n_out + n_out


def bn(c: int) -> int:
    """BatchNorm's affine weight and bias."""
    return 2 * c


def mobilenetv2_formula(c: int, classes: int) -> int:
    """Sandler et al. (2018): stem, inverted residuals (1x1 expand, 3x3 depthwise, 1x1 project), 1x1, FC."""
    total = conv(3, c, 32, bias=False) + bn(32)
    c_in = 32
    for t, c_out, n, _ in MOBILENETV2_SETTINGS:
        for _ in range(n):
            hidden = c_in * t
            if t != 1:
                total += conv(1, c_in, hidden, bias=False) + bn(hidden)
            total += 3 * 3 * hidden + bn(hidden)  # depthwise: one 3x3 filter per channel, no bias
            total += conv(1, hidden, c_out, bias=False) + bn(c_out)
            c_in = c_out
    return total + conv(1, 320, 1280, bias=False) + bn(1280) + fc(1280, classes)


def formula(name: str, c: int, s: int, classes: int = 10) -> int:
    """Table 1 (and DLG's code) counted by hand, with the FC input from the image side ``s``."""
    if name == "lenet":  # C20-MP-C50-MP-FC500-FC10, 5x5 "same" convolutions
        side = s // 2 // 2
        return conv(5, c, 20) + conv(5, 20, 50) + fc(50 * side * side, 500) + fc(500, classes)
    if name == "alexnet":  # C128x3-AP16-FC10
        side = (s - 16) // 16 + 1
        return conv(3, c, 128) + 2 * conv(3, 128, 128) + fc(128 * side * side, classes)
    if name == "vgg9":  # C32-C64-MP-C128x2-MP-D-C256x2-MP-D-FC512x2-FC10
        side = s // 8
        convs = conv(3, c, 32) + conv(3, 32, 64) + conv(3, 64, 128) + conv(3, 128, 128)
        convs += conv(3, 128, 256) + conv(3, 256, 256)
        return convs + fc(256 * side * side, 512) + fc(512, 512) + fc(512, classes)
    if name == "vgg16":  # C64x2-MP-C128x2-MP-C256x3-C512x3-MP-FC4096x2-FC1000-FC10
        side = s // 8
        convs = conv(3, c, 64) + conv(3, 64, 64) + conv(3, 64, 128) + conv(3, 128, 128)
        convs += conv(3, 128, 256) + 2 * conv(3, 256, 256) + conv(3, 256, 512) + 2 * conv(3, 512, 512)
        fcs = fc(512 * side * side, 4096) + fc(4096, 4096) + fc(4096, 1000) + fc(1000, classes)
        return convs + fcs
    if name == "mobilenetv2":
        return mobilenetv2_formula(c, classes)
    side = math.ceil(math.ceil(s / 2) / 2)  # lenet-sigmoid: strides 2, 2, 1 with padding 2
    return conv(5, c, 12) + 2 * conv(5, 12, 12) + fc(12 * side * side, classes)


# The counts the module docstring states, 10 classes; FedMA reports 3,491,530 for VGG-9 on CIFAR-10.
STATED = {
    "lenet": (1_256_080, 1_632_080),
    "alexnet": (297_738, 303_882),
    "vgg9": (2_573_450, 3_491_530),
    "vgg16": (47_400_898, 62_082_114),
    "mobilenetv2": (2_236_106, 2_236_682),
    "lenet-sigmoid": (13_426, 15_826),
}

MIN_SIZE = {"lenet": 4, "alexnet": 16, "vgg9": 8, "vgg16": 8}


@pytest.mark.parametrize("name", NAMES)
def test_parameter_counts_match_the_architecture_formula(name: str) -> None:
    for (c, s), stated in zip(INPUTS, STATED[name], strict=True):
        count = count_parameters(build_model(name, in_channels=c, image_size=s))
        assert count == formula(name, c, s) == stated


def test_mobilenetv2_has_the_published_parameter_count_and_runs_on_cifar() -> None:
    imagenet = build_model("mobilenetv2", num_classes=1000, in_channels=3, image_size=224)
    assert count_parameters(imagenet) == 3_504_872
    assert mobilenetv2_formula(3, 1000) == 3_504_872
    model = build_model("mobilenetv2", in_channels=3, image_size=32, seed=0).eval()
    assert len(model.layer_units()) == 1 + 17 + 1 + 1
    assert model(torch.rand(2, 3, 32, 32)).shape == (2, 10)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("c", "s"), INPUTS)
def test_forward_is_the_composition_of_the_layer_units(name: str, c: int, s: int) -> None:
    model = build_model(name, num_classes=7, in_channels=c, image_size=s, seed=1).eval()
    assert isinstance(model, LayerwiseNet)
    x = torch.rand(2, c, s, s, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = model(x)
        h = x
        for unit in model.layer_units():
            h = unit(h)
    assert out.shape == (2, 7)
    assert torch.isfinite(out).all()
    assert torch.equal(out, h)
    assert model.classifier is model.layer_units()[-1]
    # Every parameter lies in exactly one unit, so training unit l touches nothing else.
    unit_params = [id(p) for unit in model.layer_units() for p in unit.parameters()]
    assert sorted(unit_params) == sorted(id(p) for p in model.parameters())


@pytest.mark.parametrize("name", ["lenet", "alexnet", "vgg9", "vgg16", "lenet-sigmoid"])
def test_each_unit_holds_one_trainable_layer_and_feature_maps_stay_4d(name: str) -> None:
    model = build_model(name, in_channels=3, image_size=32, seed=0).eval()
    h = torch.zeros(1, 3, 32, 32)
    for unit in model.layer_units():
        layers = [m for m in unit.modules() if isinstance(m, nn.Conv2d | nn.Linear)]
        assert len(layers) == 1
        h = unit(h)
        assert h.ndim == (4 if isinstance(layers[0], nn.Conv2d) else 2)


def test_dropout_sits_where_table_1_puts_it() -> None:
    vgg9 = build_model("vgg9", in_channels=3, image_size=32)
    drops = [
        (i, m.p)
        for i, u in enumerate(vgg9.layer_units())
        for m in u.modules()
        if isinstance(m, nn.Dropout | nn.Dropout2d)
    ]
    assert drops == [(3, 0.05), (5, 0.1)]
    mobilenet = build_model("mobilenetv2", in_channels=3, image_size=32)
    last_conv = mobilenet.layer_units()[-2]
    assert [type(m) for m in last_conv] == [
        nn.Conv2d,
        nn.BatchNorm2d,
        nn.ReLU6,
        nn.AdaptiveAvgPool2d,
        nn.Dropout,
    ]
    assert last_conv[-1].p == 0.2


@pytest.mark.parametrize(("c", "s", "inputs"), [(3, 32, 768), (1, 28, 588)])
def test_sigmoid_lenet_fc_inputs(c: int, s: int, inputs: int) -> None:
    model = build_model("lenet-sigmoid", in_channels=c, image_size=s, seed=0)
    assert isinstance(model, LeNetSigmoid)
    assert model.fc_in_features == inputs
    assert model.classifier[-1].in_features == inputs
    assert [type(m) for m in model.modules() if isinstance(m, nn.Sigmoid | nn.ReLU)] == [nn.Sigmoid] * 3


def test_sigmoid_lenet_matches_the_dlg_reference_code_for_the_same_seed() -> None:
    def weights_init(m: nn.Module) -> None:  # Zhu et al.'s code
        if hasattr(m, "weight"):
            m.weight.data.uniform_(-0.5, 0.5)
        if hasattr(m, "bias"):
            m.bias.data.uniform_(-0.5, 0.5)

    torch.manual_seed(5)
    body = nn.Sequential(
        nn.Conv2d(3, 12, kernel_size=5, padding=5 // 2, stride=2),
        nn.Sigmoid(),
        nn.Conv2d(12, 12, kernel_size=5, padding=5 // 2, stride=2),
        nn.Sigmoid(),
        nn.Conv2d(12, 12, kernel_size=5, padding=5 // 2, stride=1),
        nn.Sigmoid(),
    )
    reference = nn.Sequential(body, nn.Sequential(nn.Linear(768, 10)))
    reference.apply(weights_init)
    ours = build_model("lenet-sigmoid", in_channels=3, image_size=32, seed=5)
    pairs = list(zip(reference.parameters(), ours.parameters(), strict=True))
    assert all(torch.equal(a, b) for a, b in pairs)
    assert all(p.abs().max() <= 0.5 for p in ours.parameters())


def test_sigmoid_lenet_init_is_optional_and_seeded_by_a_generator() -> None:
    def params(model: nn.Module) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    a = LeNetSigmoid(10, 1, 28, generator=torch.Generator().manual_seed(3))
    b = LeNetSigmoid(10, 1, 28, generator=torch.Generator().manual_seed(3))
    c = LeNetSigmoid(10, 1, 28, generator=torch.Generator().manual_seed(4))
    assert torch.equal(params(a), params(b))
    assert not torch.equal(params(a), params(c))
    # DLG's init spreads the FC weights over (-0.5, 0.5); PyTorch's default bounds them by 1/sqrt(588).
    assert a.classifier[-1].weight.abs().max() > 0.45
    plain = LeNetSigmoid(10, 1, 28, dlg_init=False)
    assert plain.classifier[-1].weight.abs().max() <= 1 / math.sqrt(588)
    assert dlg_uniform_init_(plain, torch.Generator().manual_seed(3)) is plain
    assert torch.equal(params(plain), params(a))


@pytest.mark.parametrize("name", NAMES)
def test_seeded_builds_are_reproducible_and_leave_the_global_rng_alone(name: str) -> None:
    def params(seed: int) -> torch.Tensor:
        model = build_model(name, in_channels=1, image_size=16, seed=seed)
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    torch.manual_seed(123)
    state = torch.get_rng_state()
    first = params(7)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(first, params(7))
    assert not torch.equal(first, params(8))


def test_unknown_name_lists_the_allowed_ones() -> None:
    assert list(MODELS) == NAMES
    with pytest.raises(ConfigError, match="'resnet18'") as error:
        build_model("resnet18")
    assert all(name in str(error.value) for name in NAMES)


@pytest.mark.parametrize("name", sorted(MIN_SIZE))
def test_too_small_images_name_the_size_and_the_minimum(name: str) -> None:
    smallest = MIN_SIZE[name]
    model = build_model(name, image_size=smallest, seed=0).eval()
    assert model(torch.rand(2, 1, smallest, smallest)).shape == (2, 10)
    with pytest.raises(ConfigError, match=rf"image_size {smallest - 1} .*image_size >= {smallest}"):
        build_model(name, image_size=smallest - 1)


@pytest.mark.parametrize("name", ["mobilenetv2", "lenet-sigmoid"])
def test_padded_networks_take_any_positive_size(name: str) -> None:
    model = build_model(name, image_size=1, seed=0).eval()
    assert model(torch.rand(2, 1, 1, 1)).shape == (2, 10)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_classes": 0}, "num_classes must be an integer >= 1, not 0"),
        ({"in_channels": 2.0}, "in_channels must be an integer >= 1, not 2.0"),
        ({"image_size": True}, "image_size must be an integer >= 1, not True"),
        ({"image_size": 0}, "image_size must be an integer >= 1, not 0"),
        ({"seed": -1}, "seed must be None or an integer >= 0, not -1"),
        ({"seed": "0"}, "seed must be None or an integer >= 0, not '0'"),
    ],
)
def test_bad_arguments_are_config_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_model("lenet", **kwargs)


def test_mobilenetv2_initialisation_follows_torchvision() -> None:
    model = MobileNetV2(10, 3, 32)
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert len(bns) == 52
    assert all(torch.equal(m.weight, torch.ones_like(m.weight)) for m in bns)
    head = model.classifier[-1]
    assert torch.equal(head.bias, torch.zeros(10))
    assert head.weight.std().item() == pytest.approx(0.01, rel=0.1)


def test_importing_the_zoo_is_cheap() -> None:
    code = (
        "import sys, torch; before = set(sys.modules); import fedveil.models.zoo; "
        "print(' '.join(sorted(set(sys.modules) - before)))"
    )
    run = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert set(run.stdout.split()) == {
        "fedveil",
        "fedveil._version",
        "fedveil.errors",
        "fedveil.models",
        "fedveil.models.vision",
        "fedveil.models.zoo",
    }


def test_darknet_initialisation_keeps_vgg9s_signal() -> None:
    """Darknet's initialisation (PPFL's own framework): conv and FC weights within sqrt(2 / fan_in),
    biases zero, the same values for the same seed. Through VGG9's nine ReLU layers without batch norm,
    PyTorch's default leaves the logits nearly independent of the input; Darknet's keeps 10x more of it."""
    model = build_model("vgg9", in_channels=1, image_size=28, seed=3, init="darknet")
    for module in model.modules():
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            assert module.weight.abs().max() <= math.sqrt(2 / module.weight[0].numel())
            assert not module.bias.any()
    again = build_model("vgg9", in_channels=1, image_size=28, seed=3, init="darknet")
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True))
    x = torch.rand(64, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    spread = {}
    for init in ("torch", "darknet"):
        net = build_model("vgg9", in_channels=1, image_size=28, seed=0, init=init).eval()
        with torch.no_grad():
            out = net(x)
        spread[init] = (out - out.mean(0)).std().item()  # how much the logits depend on the input
    assert spread["darknet"] > 10 * spread["torch"]
    with pytest.raises(ConfigError, match="unknown initialisation 'he'; choose one of torch, darknet"):
        build_model("vgg9", init="he")
