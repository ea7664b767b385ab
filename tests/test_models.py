"""The models a job can name, users' models by import path (only from modules the machine's operator allowed), and
the parameter views nodes exchange."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nodeagent.jobspec import ModelSpec
from nodeagent.training.models import MODELS, ModelError, build_model, flat_parameters, parameter_specs

pytestmark = pytest.mark.unit

SMALL_OPTIONS = {
    "logistic": {},
    "mlp": {"hidden": [32, 16]},
    "cnn": {},
    "resnet-gn": {"depth": 18, "width": 16},
    "resnet-cifar": {"depth": 8, "width": 8},
}


# A user's module of model factories, and a package holding another; written into a directory on sys.path.
USER_MODULE = "peertrain_user_models"
USER_PACKAGE = "peertrain_user_package"
FACTORIES = """
import math
from subprocess import run  # imported into the module, so never a job's to call

from torch import nn


def tiny(input_shape, num_classes, hidden=8):
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), hidden), nn.Linear(hidden, num_classes))


def linear(in_features, out_features):
    return nn.Linear(in_features, out_features)


def not_a_module():
    return "a string"
"""


@pytest.fixture
def user_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / f"{USER_MODULE}.py").write_text(FACTORIES)
    (tmp_path / USER_PACKAGE).mkdir()
    (tmp_path / USER_PACKAGE / "__init__.py").write_text("")
    (tmp_path / USER_PACKAGE / "models.py").write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in (USER_MODULE, USER_PACKAGE, f"{USER_PACKAGE}.models"):  # imported afresh by each test
        monkeypatch.delitem(sys.modules, name, raising=False)


def forward_backward(model: nn.Module, batch: int = 4) -> torch.Tensor:
    torch.manual_seed(1)
    images = torch.randn(batch, 1, 28, 28)
    labels = torch.randint(0, 10, (batch,))
    logits = model(images)
    F.cross_entropy(logits, labels).backward()
    return logits


def test_every_registered_model_is_tested() -> None:
    # The classifiers here; gpt, the language model, in tests/test_language_model.py.
    assert sorted(set(MODELS) - {"gpt"}) == sorted(SMALL_OPTIONS)


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
        ({"group_channels": 0}, "group_channels"),
        ({"dropout_fc": 1.0}, "dropout_fc"),
        ({"blocks": 3}, "blocks"),
    ],
)
def test_resnet_gn_bad_options(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_model(ModelSpec(name="resnet-gn", options=options))


def test_resnet_cifar_parameter_counts() -> None:
    # From the layer shapes (3x3 convolutions without bias; GroupNorm has a weight and a bias per channel, as
    # BatchNorm has, so the counts are He et al.'s plus the two 1x1 projections), with n blocks per stage:
    #   stem:      conv 3*16*9 = 432, norm 2*16 = 32
    #   stage 16:  2n convs of 16*16*9 = 2304, 2n norms of 32
    #   stage 32:  conv 16*32*9 = 4608, 2n-1 convs of 32*32*9 = 9216, 2n norms of 64; projection 16*32 + 64 = 576
    #   stage 64:  conv 32*64*9 = 18432, 2n-1 convs of 64*64*9 = 36864, 2n norms of 128; projection 32*64 + 128 = 2176
    #   classifier 64*10 + 10 = 650
    # n = 3 (ResNet-20): 464 + 6*2336 + (4608 + 5*9216 + 6*64 + 576) + (18432 + 5*36864 + 6*128 + 2176) + 650
    #                    = 272,474 (He et al.: 0.27M with identity shortcuts, 269,722)
    # n = 5 (ResNet-32): 464 + 10*2336 + (4608 + 9*9216 + 10*64 + 576) + (18432 + 9*36864 + 10*128 + 2176) + 650
    #                    = 466,906 (He et al.: 0.46M)
    counts = {depth: flat_parameters(build_model(ModelSpec(name="resnet-cifar", options={"depth": depth}),
                                                 input_shape=(3, 32, 32))).numel() for depth in (20, 32)}
    assert counts == {20: 272_474, 32: 466_906}


def test_resnet_cifar_layout() -> None:
    model = build_model(ModelSpec(name="resnet-cifar", options={"depth": 32}), input_shape=(3, 32, 32))
    convolutions = [module for module in model.modules() if isinstance(module, nn.Conv2d)]
    # 32 weighted layers: the stem, 3 stages of 5 blocks of two 3x3 convolutions, the classifier.
    assert sum(conv.kernel_size == (3, 3) for conv in convolutions) == 1 + 3 * 5 * 2
    assert len([module for module in model.modules() if isinstance(module, nn.Linear)]) == 1
    assert sum(conv.kernel_size == (1, 1) for conv in convolutions) == 2  # the projections into stages 2 and 3
    assert {conv.out_channels for conv in convolutions} == {16, 32, 64}
    norms = [module for module in model.modules() if isinstance(module, nn.GroupNorm)]
    assert {(norm.num_channels, norm.num_groups) for norm in norms} == {(16, 2), (32, 4), (64, 8)}
    assert not any(isinstance(module, nn.modules.batchnorm._BatchNorm) for module in model.modules())
    assert len(list(model.buffers())) == 0
    # Options: twice the width, and the ECL-ISVR code's 32 channels per group.
    wide = build_model(ModelSpec(name="resnet-cifar", options={"width": 32, "group_channels": 32}))
    assert {(norm.num_channels, norm.num_groups) for norm in wide.modules() if isinstance(norm, nn.GroupNorm)} == {
        (32, 1), (64, 2), (128, 4)}


def test_resnet_cifar_sgd_lowers_the_loss() -> None:
    torch.manual_seed(0)
    model = build_model(ModelSpec(name="resnet-cifar", options={"depth": 8}), input_shape=(3, 32, 32))
    images, labels = torch.randn(8, 3, 32, 32), torch.arange(8) % 10
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.85 * losses[0]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"depth": 34}, "depth must be 6n \\+ 2"),
        ({"depth": 2}, "depth"),
        ({"width": 0}, "width"),
        ({"group_channels": 0}, "group_channels"),
        ({"width": 10}, "20 channels cannot be cut into ceil\\(20/8\\) = 3 equal groups"),
        ({"dropout_conv": -0.1}, "dropout_conv"),
        ({"blocks": 3}, "blocks"),
    ],
)
def test_resnet_cifar_bad_options(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_model(ModelSpec(name="resnet-cifar", options=options), input_shape=(3, 32, 32))


SHAPES = [(1, 28, 28), (3, 32, 32), (3, 30, 30), (1, 7, 7), (3, 32, 20)]


@pytest.mark.parametrize("shape", SHAPES, ids=[str(shape) for shape in SHAPES])
@pytest.mark.parametrize("name", sorted(SMALL_OPTIONS))
def test_every_model_is_sized_from_the_data(name: str, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    model = build_model(ModelSpec(name=name, options=SMALL_OPTIONS[name]), input_shape=shape, num_classes=100)
    assert model(torch.randn(2, *shape)).shape == (2, 100)


@pytest.mark.parametrize("name", ["logistic", "mlp"])
def test_dense_models_take_feature_vectors(name: str) -> None:
    model = build_model(ModelSpec(name=name, options=SMALL_OPTIONS[name]), input_shape=(20,), num_classes=3)
    assert model(torch.randn(2, 20)).shape == (2, 3)


@pytest.mark.parametrize("shape", [(20,), (28, 28), (1, 1, 28, 28)])
@pytest.mark.parametrize("name", ["cnn", "resnet-gn", "resnet-cifar"])
def test_image_models_refuse_samples_that_are_not_images(name: str, shape: tuple[int, ...]) -> None:
    with pytest.raises(ModelError, match=f"{name} needs images of shape \\(channels, height, width\\), but the "
                                         f"dataset's samples have shape {re.escape(str(shape))}"):
        build_model(ModelSpec(name=name, options=SMALL_OPTIONS[name]), input_shape=shape)


def test_cnn_refuses_images_its_poolings_would_empty() -> None:
    with pytest.raises(ModelError, match="cnn needs images of at least 4 x 4 pixels, but the dataset's are 3 x 28"):
        build_model(ModelSpec(name="cnn"), input_shape=(1, 3, 28))


@pytest.mark.usefixtures("user_modules")
def test_model_by_import_path_gets_options_and_shapes() -> None:
    spec = ModelSpec(name=f"{USER_MODULE}:tiny", options={"hidden": 5})
    model = build_model(spec, input_shape=(1, 28, 28), num_classes=7, allow_imports=(USER_MODULE,))
    assert [shape for _, _, shape in parameter_specs(model)] == [(5, 784), (5,), (7, 5), (7,)]


@pytest.mark.usefixtures("user_modules")
def test_model_by_import_path_without_shape_parameters() -> None:
    # linear takes neither input_shape nor num_classes: it gets only the options.
    spec = ModelSpec(name=f"{USER_MODULE}:linear", options={"in_features": 3, "out_features": 2})
    model = build_model(spec, allow_imports=(USER_MODULE,))
    assert isinstance(model, nn.Linear) and model.weight.shape == (2, 3)


@pytest.mark.usefixtures("user_modules")
@pytest.mark.parametrize(
    ("name", "allowed"),
    [
        (f"{USER_MODULE}:tiny", ()),  # nothing is allowed by default
        (f"{USER_MODULE}:tiny", (USER_PACKAGE, f"{USER_MODULE}.tiny")),
        (f"{USER_PACKAGE}.models:tiny", (USER_PACKAGE,)),  # a package allows none of its modules
    ],
)
def test_a_module_not_allowed_is_refused_naming_the_flag_and_never_imported(name: str, allowed: tuple) -> None:
    module = name.partition(":")[0]
    with pytest.raises(ValueError, match=f"module {module} is not allowed on this machine; its operator allows it "
                                         f"with --allow-import {module}"):
        build_model(ModelSpec(name=name), allow_imports=allowed)
    assert module not in sys.modules and USER_PACKAGE not in sys.modules


@pytest.mark.usefixtures("user_modules")
def test_a_submodule_allowed_exactly_is_imported() -> None:
    model = build_model(ModelSpec(name=f"{USER_PACKAGE}.models:tiny"), allow_imports=(f"{USER_PACKAGE}.models",))
    assert isinstance(model, nn.Sequential)


@pytest.mark.usefixtures("user_modules")
@pytest.mark.parametrize(
    ("name", "allowed", "message"),
    [
        ("os:system", ("os",), "os is Python's standard library, never a model's module"),
        ("subprocess:run", ("subprocess",), "standard library"),
        (f"{USER_MODULE}:run", (USER_MODULE,), f"run is not defined in {USER_MODULE} but imported into it"),
        ("os.path:join x", ("os.path",), "must read 'package.module:factory'"),
    ],
)
def test_what_no_operator_can_allow_is_refused(name: str, allowed: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_model(ModelSpec(name=name), allow_imports=allowed)


@pytest.mark.usefixtures("user_modules")
@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("transformer", {}, "unknown model 'transformer'; known: logistic, mlp, cnn, resnet-gn, resnet-cifar, gpt, or"),
        ("no_such_package_xyz.models:build", {}, "cannot import no_such_package_xyz.models"),
        (f"{USER_MODULE}:NoSuchLayer", {}, "no callable named 'NoSuchLayer'"),
        (":factory", {}, "package.module:factory"),
        (f"{USER_MODULE}:not_a_module", {}, "returned str, not a torch.nn.Module"),
        (f"{USER_MODULE}:tiny", {"depth": 3}, "depth"),
        ("mlp", {"hidden": "200"}, "hidden"),
        ("logistic", {"num_classes": 5}, "num_classes comes from the dataset"),
    ],
)
def test_bad_model_names_and_options(name: str, options: dict, message: str) -> None:
    allowed = (USER_MODULE, "no_such_package_xyz.models")
    with pytest.raises(ValueError, match=message):
        build_model(ModelSpec(name=name, options=options), allow_imports=allowed)


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
