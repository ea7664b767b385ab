"""The models a job can name, and the flat views of their parameters that the algorithms exchange.

build_model only constructs: the caller seeds torch (torch.manual_seed) beforehand, so that every node
builds the same initial model.
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from nodeagent.jobspec import JobSpec, ModelSpec
from nodeagent.training.data import DATASETS

__all__ = [
    "MODELS",
    "build_model",
    "cnn",
    "flat_parameters",
    "initial_model",
    "logistic",
    "mlp",
    "parameter_specs",
    "resnet_gn",
]

InputShape = tuple[int, ...]


def logistic(input_shape: InputShape = (1, 28, 28), num_classes: int = 10) -> nn.Module:
    """Multinomial logistic regression: one linear layer on the flattened image."""
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes))


def mlp(input_shape: InputShape = (1, 28, 28), num_classes: int = 10, hidden: Sequence[int] = (200,)) -> nn.Module:
    """Fully connected layers of the given widths, each followed by ReLU, then the linear classifier."""
    if isinstance(hidden, str | bytes) or not all(isinstance(width, int) and width > 0 for width in hidden):
        raise ValueError(f"mlp: hidden must be a list of positive integers, got {hidden!r}")
    layers: list[nn.Module] = [nn.Flatten()]
    width_in = math.prod(input_shape)
    for width in hidden:
        layers += [nn.Linear(width_in, width), nn.ReLU()]
        width_in = width
    layers.append(nn.Linear(width_in, num_classes))
    return nn.Sequential(*layers)


def cnn(input_shape: InputShape = (1, 28, 28), num_classes: int = 10) -> nn.Module:
    """The AdaComp network: conv3x3-32, pool, conv3x3-64, pool, fc 128, fc 10.

    The convolutions are padded ("same"), so a 28x28 image gives 14x14 and then 7x7 feature maps: the
    paper does not fix the padding, and padding keeps every pixel of the border in play.
    """
    channels, height, width = input_shape
    return nn.Sequential(
        nn.Conv2d(channels, 32, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * (height // 4) * (width // 4), 128),
        nn.ReLU(),
        nn.Linear(128, num_classes),
    )


def _group_norm(channels: int) -> nn.GroupNorm:
    # ceil(C / 32) groups, the ECL-ISVR choice: about 32 channels per group.
    groups = math.ceil(channels / 32)
    if channels % groups:
        raise ValueError(f"resnet-gn: {channels} channels cannot be cut into ceil({channels}/32) = {groups} groups")
    return nn.GroupNorm(groups, channels)


class _BasicBlock(nn.Module):
    """Two 3x3 convolutions with GroupNorm and a residual connection (projected when the shape changes)."""

    def __init__(self, channels_in: int, channels_out: int, stride: int, dropout: float) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride=stride, padding=1, bias=False)
        self.norm1 = _group_norm(channels_out)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, padding=1, bias=False)
        self.norm2 = _group_norm(channels_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or channels_in != channels_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(channels_in, channels_out, 1, stride=stride, bias=False), _group_norm(channels_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.dropout(torch.relu(self.norm1(self.conv1(x))))
        out = self.norm2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


_RESNET_LAYOUTS = {18: (2, 2, 2, 2), 34: (3, 4, 6, 3)}


def resnet_gn(
    input_shape: InputShape = (1, 28, 28),
    num_classes: int = 10,
    depth: int = 34,
    width: int = 64,
    dropout_conv: float = 0.1,
    dropout_fc: float = 0.5,
) -> nn.Module:
    """A ResNet (BasicBlocks) with GroupNorm instead of BatchNorm, whose batch statistics would differ
    between nodes holding different classes. Four stages of width, 2, 4 and 8 x width channels.

    The stem is one 3x3 convolution without the ImageNet 7x7 convolution and max-pool, which would shrink
    a 28x28 image to 7x7 before the first block; the stages then see 28, 14, 7 and 4 pixels a side.
    """
    if depth not in _RESNET_LAYOUTS:
        raise ValueError(f"resnet-gn: depth must be one of {sorted(_RESNET_LAYOUTS)}, got {depth!r}")
    if not (isinstance(width, int) and width > 0):
        raise ValueError(f"resnet-gn: width must be a positive integer, got {width!r}")
    for name, rate in (("dropout_conv", dropout_conv), ("dropout_fc", dropout_fc)):
        if not (isinstance(rate, int | float) and 0 <= rate < 1):
            raise ValueError(f"resnet-gn: {name} must be in [0, 1), got {rate!r}")
    layers: list[nn.Module] = [
        nn.Conv2d(input_shape[0], width, 3, padding=1, bias=False),
        _group_norm(width),
        nn.ReLU(),
    ]
    channels = width
    for stage, blocks in enumerate(_RESNET_LAYOUTS[depth]):
        channels_out = width * 2**stage
        for block in range(blocks):
            stride = 2 if stage > 0 and block == 0 else 1
            layers.append(_BasicBlock(channels, channels_out, stride, dropout_conv))
            channels = channels_out
    layers += [
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Dropout(dropout_fc),
        nn.Linear(channels, num_classes),
    ]
    return nn.Sequential(*layers)


MODELS: dict[str, Callable[..., nn.Module]] = {
    "logistic": logistic,
    "mlp": mlp,
    "cnn": cnn,
    "resnet-gn": resnet_gn,
}


def _import_factory(path: str) -> Callable[..., nn.Module]:
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"model {path!r}: an import path must read 'package.module:factory'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"model {path!r}: cannot import {module_name}: {error}") from error
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise ValueError(f"model {path!r}: {module_name} has no callable named {attribute!r}")
    return factory


def build_model(spec: ModelSpec, input_shape: InputShape = (1, 28, 28), num_classes: int = 10) -> nn.Module:
    """Builds the model a job names: a registry name, or a user's factory as 'package.module:factory'.

    The factory is called with spec.options as keyword arguments, plus input_shape and num_classes when its
    signature accepts them. Raises ValueError for an unknown name, an option the factory does not take, or
    an import that fails.
    """
    factory = _import_factory(spec.name) if ":" in spec.name else _registered(spec)
    kwargs = _arguments(spec, factory, input_shape, num_classes)
    model = factory(**kwargs)
    if not isinstance(model, nn.Module):
        raise ValueError(f"model {spec.name!r}: the factory returned {type(model).__name__}, not a torch.nn.Module")
    return model


def initial_model(spec: JobSpec) -> nn.Module:
    """The job's seeded initial model, identical on every node and at the parameter server, shaped for its
    dataset's samples. It seeds torch's global generator with the job's seed, so that what a node draws next
    (dropout) is the same on every run; a caller that must keep its own random state forks it first."""
    info = DATASETS[spec.data.dataset]
    torch.manual_seed(spec.seed)
    return build_model(spec.model, info.input_shape, info.num_classes)


def check_model(spec: ModelSpec, input_shape: InputShape, num_classes: int) -> None:
    """What can be known of a job's model without building it, nor importing a user's code (an import path is
    the agents' to check): a registry model's name and options. ValueError naming the problem."""
    if ":" not in spec.name:
        _arguments(spec, _registered(spec), input_shape, num_classes)


def _registered(spec: ModelSpec) -> Callable[..., nn.Module]:
    if spec.name not in MODELS:
        known = ", ".join(MODELS)
        raise ValueError(f"unknown model {spec.name!r}; known: {known}, or 'package.module:factory'")
    return MODELS[spec.name]


def _arguments(spec: ModelSpec, factory: Callable[..., nn.Module], input_shape: InputShape,
               num_classes: int) -> dict[str, object]:
    """The factory's keyword arguments: the job's options, and the data's shape and classes where it takes them."""
    signature = inspect.signature(factory)
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
    kwargs = dict(spec.options)
    for name, value in (("input_shape", tuple(input_shape)), ("num_classes", num_classes)):
        if name in spec.options:
            raise ValueError(f"model {spec.name!r}: {name} comes from the dataset and cannot be an option")
        if takes_any or name in signature.parameters:
            kwargs[name] = value
    try:
        signature.bind(**kwargs)
    except TypeError as error:
        raise ValueError(f"model {spec.name!r}: options {sorted(spec.options)} do not fit: {error}") from None
    return kwargs


def flat_parameters(model: nn.Module) -> torch.Tensor:
    """A copy of the trainable parameters as one flat vector, in named_parameters() order."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters() if p.requires_grad])


def parameter_specs(model: nn.Module) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(name, dtype, shape) of each trainable parameter: what nodes exchange. Buffers are not exchanged."""
    return [(name, p.dtype, tuple(p.shape)) for name, p in model.named_parameters() if p.requires_grad]
