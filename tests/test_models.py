"""The models a job can name, users' models by import path (only from modules the machine's operator allowed), and
the parameter views nodes exchange."""

from __future__ import annotations

import sys
from pathlib import Path

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
        ("transformer", {}, "unknown model 'transformer'; known: logistic, mlp, cnn, resnet-gn"),
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
