"""The models a job can name, users' models by import path, and the parameter views nodes exchange."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nodeagent.jobspec import ModelSpec
from nodeagent.training.models import MODELS, build_model, flat_parameters, parameter_specs

SMALL_OPTIONS = {
    "logistic": {},
    "mlp": {"hidden": [32, 16]},
    "cnn": {},
    "resnet-gn": {"depth": 18, "width": 16},
}


# Factories a user could write, found through this module's import path.
def tiny_factory(input_shape: tuple[int, ...], num_classes: int, hidden: int = 8) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), hidden), nn.Linear(hidden, num_classes))


def not_a_module() -> str:
    return "a string"


def forward_backward(model: nn.Module, batch: int = 4) -> torch.Tensor:
    torch.manual_seed(1)
    images = torch.randn(batch, 1, 28, 28)
    labels = torch.randint(0, 10, (batch,))
    logits = model(images)
    F.cross_entropy(logits, labels).backward()
    return logits


def test_every_registered_model_is_tested() -> None:
    assert sorted(MODELS) == sorted(SMALL_OPTIONS)


@pytest.mark.parametrize("name", sorted(SMALL_OPTIONS))
def test_forward_and_backward(name: str) -> None:
    torch.manual_seed(0)
    model = build_model(ModelSpec(name=name, options=SMALL_OPTIONS[name]))
    logits = forward_backward(model)
    assert logits.shape == (4, 10)
    for parameter_name, parameter in model.named_parameters():
        assert parameter.grad is not None, parameter_name
        assert torch.isfinite(parameter.grad).all(), parameter_name
    assert any(parameter.grad.abs().sum() > 0 for parameter in model.parameters())


@pytest.mark.parametrize("name", sorted(SMALL_OPTIONS))
def test_same_seed_same_initial_model(name: str) -> None:
    spec = ModelSpec(name=name, options=SMALL_OPTIONS[name])
    torch.manual_seed(5)
    first = flat_parameters(build_model(spec))
    torch.manual_seed(5)
    second = flat_parameters(build_model(spec))
    torch.manual_seed(6)
    other = flat_parameters(build_model(spec))
    assert torch.equal(first, second) and not torch.equal(first, other)


def test_mlp_hidden_widths() -> None:
    model = build_model(ModelSpec(name="mlp", options={"hidden": [64, 32]}))
    shapes = [shape for _, _, shape in parameter_specs(model)]
    assert shapes == [(64, 784), (64,), (32, 64), (32,), (10, 32), (10,)]
    default = parameter_specs(build_model(ModelSpec(name="mlp")))
    assert default[0][2] == (200, 784) and len(default) == 4


def test_cnn_is_the_adacomp_network() -> None:
    shapes = [shape for _, _, shape in parameter_specs(build_model(ModelSpec(name="cnn")))]
    assert shapes == [(32, 1, 3, 3), (32,), (64, 32, 3, 3), (64,), (128, 64 * 7 * 7), (128,), (10, 128), (10,)]


def test_resnet_gn_ecl_configuration() -> None:
    # The ECL-ISVR network: depth 34 layout, width 64, GroupNorm with ceil(C/32) groups, no BatchNorm.
    model = build_model(ModelSpec(name="resnet-gn"))
    norms = [module for module in model.modules() if isinstance(module, nn.GroupNorm)]
    assert {(norm.num_channels, norm.num_groups) for norm in norms} == {(64, 2), (128, 4), (256, 8), (512, 16)}
    assert not any(isinstance(module, nn.modules.batchnorm._BatchNorm) for module in model.modules())
    # 3 + 4 + 6 + 3 blocks of two 3x3 convolutions, the stem and three 1x1 projections.
    convolutions = [module for module in model.modules() if isinstance(module, nn.Conv2d)]
    assert sum(conv.kernel_size == (3, 3) for conv in convolutions) == 1 + 2 * 16
    assert sum(conv.kernel_size == (1, 1) for conv in convolutions) == 3
    assert {module.p for module in model.modules() if isinstance(module, nn.Dropout)} == {0.1, 0.5}
    # Buffers are not exchanged, and GroupNorm keeps none: the flat vector is the whole state.
    assert len(list(model.buffers())) == 0


def test_resnet_gn_depth_34_runs_on_28x28() -> None:
    model = build_model(ModelSpec(name="resnet-gn", options={"depth": 34, "width": 8}))
    assert forward_backward(model, batch=2).shape == (2, 10)


def test_resnet_gn_dropout_is_active_in_training_only() -> None:
    torch.manual_seed(0)
    model = build_model(ModelSpec(name="resnet-gn", options={"depth": 18, "width": 16}))
    images = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        assert not torch.equal(model(images), model(images))
        model.eval()
        assert torch.equal(model(images), model(images))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"depth": 50}, "depth"),
        ({"width": 0}, "width"),
        ({"width": 40}, "groups"),  # 80 channels do not divide into ceil(80/32) = 3 groups
        ({"dropout_fc": 1.0}, "dropout_fc"),
        ({"blocks": 3}, "blocks"),
    ],
)
def test_resnet_gn_bad_options(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_model(ModelSpec(name="resnet-gn", options=options))


def test_model_by_import_path_gets_options_and_shapes() -> None:
    spec = ModelSpec(name=f"{__name__}:tiny_factory", options={"hidden": 5})
    model = build_model(spec, input_shape=(1, 28, 28), num_classes=7)
    assert [shape for _, _, shape in parameter_specs(model)] == [(5, 784), (5,), (7, 5), (7,)]


def test_model_by_import_path_without_shape_parameters() -> None:
    # nn.Linear takes neither input_shape nor num_classes: it gets only the options.
    model = build_model(ModelSpec(name="torch.nn:Linear", options={"in_features": 3, "out_features": 2}))
    assert isinstance(model, nn.Linear) and model.weight.shape == (2, 3)


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("transformer", {}, "unknown model 'transformer'; known: logistic, mlp, cnn, resnet-gn"),
        ("no_such_package_xyz.models:build", {}, "cannot import no_such_package_xyz.models"),
        ("torch.nn:NoSuchLayer", {}, "no callable named 'NoSuchLayer'"),
        (":factory", {}, "package.module:factory"),
        (f"{__name__}:not_a_module", {}, "returned str, not a torch.nn.Module"),
        (f"{__name__}:tiny_factory", {"depth": 3}, "depth"),
        ("mlp", {"hidden": "200"}, "hidden"),
        ("logistic", {"num_classes": 5}, "num_classes comes from the dataset"),
    ],
)
def test_bad_model_names_and_options(name: str, options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_model(ModelSpec(name=name, options=options))


def test_parameter_specs_and_flat_vector_cover_trainable_parameters_only() -> None:
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    model[0].bias.requires_grad_(False)
    assert parameter_specs(model) == [
        ("0.weight", torch.float32, (2, 3)),
        ("1.weight", torch.float32, (2,)),
        ("1.bias", torch.float32, (2,)),
    ]
    flat = flat_parameters(model)
    expected = torch.cat([model[0].weight.reshape(-1), model[1].weight, model[1].bias])
    assert torch.equal(flat, expected.detach())
    flat.zero_()  # a copy: changing it leaves the model alone
    assert model[0].weight.abs().sum() > 0


def test_logistic_flat_vector_matches_the_layer() -> None:
    model = build_model(ModelSpec(name="logistic"))
    assert parameter_specs(model) == [("1.weight", torch.float32, (10, 784)), ("1.bias", torch.float32, (10,))]
    assert flat_parameters(model).shape == (7850,)
