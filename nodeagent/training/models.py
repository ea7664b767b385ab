"""The models a job can name, and the flat views of their parameters that the algorithms exchange.

build_model only constructs: the caller seeds torch (torch.manual_seed) beforehand, so that every node
builds the same initial model.

A job may name its own model factory as 'package.module:factory'. Since whoever submits a job is not trusted with
the machines, such a module is imported only where its machine's operator allowed it (`--allow-import
package.module` of `nodeagent serve` and `coordinator simulate`: the `allow_imports` of build_model). The
coordinator never imports one: it checks the path's form only (check_model).
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
import sys
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

import torch
from torch import nn

from nodeagent.jobspec import MAX_SHOWN_CHARS, JobSpec, ModelSpec, shown
from nodeagent.text import clip
from nodeagent.training.data import DatasetInfo
from nodeagent.training.modelfile import ModelFileError, load_parameters

__all__ = [
    "MODELS",
    "ModelError",
    "build_model",
    "cnn",
    "flat_parameters",
    "gpt",
    "initial_model",
    "is_import_path",
    "logistic",
    "mlp",
    "module_problem",
    "parameter_specs",
    "resnet_cifar",
    "resnet_gn",
]

InputShape = tuple[int, ...]


class ModelError(ValueError):
    """A job's model that cannot be built here (not allowed, not importable, options that do not fit, samples it
    cannot take, ...); the message says which and why."""


def _image_shape(model: str, input_shape: InputShape) -> tuple[int, int, int]:
    """(channels, height, width) of a convolutional model's samples; ModelError for samples that are not images,
    before torch fails deep inside the first convolution."""
    if len(input_shape) != 3 or not all(isinstance(size, int) and size > 0 for size in input_shape):
        raise ModelError(f"{model} needs images of shape (channels, height, width), but the dataset's samples have "
                         f"shape {tuple(input_shape)}; logistic and mlp take samples of any shape")
    channels, height, width = input_shape
    return channels, height, width


def logistic(input_shape: InputShape = (1, 28, 28), num_classes: int = 10) -> nn.Module:
    """Multinomial logistic regression: one linear layer on the flattened sample (an image or a feature vector)."""
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
    channels, height, width = _image_shape("cnn", input_shape)
    if height < 4 or width < 4:  # two 2x2 poolings would leave no pixel for the fully connected layer
        raise ModelError(f"cnn needs images of at least 4 x 4 pixels, but the dataset's are {height} x {width}")
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


def _group_norm(channels: int, group_channels: int) -> nn.GroupNorm:
    # ceil(C / group_channels) groups, the ECL-ISVR code's rule: at most group_channels channels per group.
    return nn.GroupNorm(math.ceil(channels / group_channels), channels)


class _BasicBlock(nn.Module):
    """Two 3x3 convolutions with GroupNorm and a residual connection (projected when the shape changes)."""

    def __init__(self, channels_in: int, channels_out: int, stride: int, dropout: float, group_channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride=stride, padding=1, bias=False)
        self.norm1 = _group_norm(channels_out, group_channels)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, padding=1, bias=False)
        self.norm2 = _group_norm(channels_out, group_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or channels_in != channels_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(channels_in, channels_out, 1, stride=stride, bias=False),
                _group_norm(channels_out, group_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.dropout(torch.relu(self.norm1(self.conv1(x))))
        out = self.norm2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


def _resnet(
    model: str,
    input_shape: InputShape,
    num_classes: int,
    stage_blocks: Sequence[int],
    width: int,
    group_channels: int,
    dropout_conv: float,
    dropout_fc: float,
) -> nn.Module:
    """A ResNet of BasicBlocks with GroupNorm: a 3x3 convolution of `width` channels, then one stage per entry of
    stage_blocks with width x 2^stage channels (stride 2 from the second stage on), global average pooling and the
    linear classifier. `model` names it in errors; options are checked before anything is built."""
    channels_in, _, _ = _image_shape(model, input_shape)
    for name, value in (("width", width), ("group_channels", group_channels)):
        if not (isinstance(value, int) and value > 0):
            raise ValueError(f"{model}: {name} must be a positive integer, got {value!r}")
    for name, rate in (("dropout_conv", dropout_conv), ("dropout_fc", dropout_fc)):
        if not (isinstance(rate, int | float) and 0 <= rate < 1):
            raise ValueError(f"{model}: {name} must be in [0, 1), got {rate!r}")
    stage_widths = [width * 2**stage for stage in range(len(stage_blocks))]
    for channels in stage_widths:
        groups = math.ceil(channels / group_channels)
        if channels % groups:
            raise ValueError(f"{model}: {channels} channels cannot be cut into ceil({channels}/{group_channels}) = "
                             f"{groups} equal groups; choose width and group_channels so that they can")
    layers: list[nn.Module] = [
        nn.Conv2d(channels_in, width, 3, padding=1, bias=False),
        _group_norm(width, group_channels),
        nn.ReLU(),
    ]
    channels = width
    for stage, (blocks, channels_out) in enumerate(zip(stage_blocks, stage_widths, strict=True)):
        for block in range(blocks):
            stride = 2 if stage > 0 and block == 0 else 1
            layers.append(_BasicBlock(channels, channels_out, stride, dropout_conv, group_channels))
            channels = channels_out
    layers += [
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Dropout(dropout_fc),
        nn.Linear(channels, num_classes),
    ]
    return nn.Sequential(*layers)


_RESNET_LAYOUTS = {18: (2, 2, 2, 2), 34: (3, 4, 6, 3)}


def resnet_gn(
    input_shape: InputShape = (1, 28, 28),
    num_classes: int = 10,
    depth: int = 34,
    width: int = 64,
    group_channels: int = 32,
    dropout_conv: float = 0.1,
    dropout_fc: float = 0.5,
) -> nn.Module:
    """A ResNet (BasicBlocks) with GroupNorm instead of BatchNorm, whose batch statistics would differ
    between nodes holding different classes. Four stages of width, 2, 4 and 8 x width channels, the ImageNet
    layouts of ResNet-18 and -34; GroupNorm has ceil(C / group_channels) groups.

    The defaults are the network of the ECL-ISVR code (which calls it "resnet32"): the depth 34 layout, width 64,
    32 channels per group, dropout 0.1 in the blocks and 0.5 before the classifier. The stem is one 3x3
    convolution without the ImageNet 7x7 convolution and max-pool, which would shrink a 28x28 image to 7x7
    before the first block; the stages then see 28, 14, 7 and 4 pixels a side.
    """
    if depth not in _RESNET_LAYOUTS:
        raise ValueError(f"resnet-gn: depth must be one of {sorted(_RESNET_LAYOUTS)}, got {depth!r}")
    return _resnet("resnet-gn", input_shape, num_classes, _RESNET_LAYOUTS[depth], width, group_channels,
                   dropout_conv, dropout_fc)


def resnet_cifar(
    input_shape: InputShape = (3, 32, 32),
    num_classes: int = 10,
    depth: int = 20,
    width: int = 16,
    group_channels: int = 8,
    dropout_conv: float = 0.0,
    dropout_fc: float = 0.0,
) -> nn.Module:
    """The CIFAR ResNets of He et al. (2016, section 4.2) with GroupNorm instead of BatchNorm: a 3x3 convolution
    of `width` (16) channels, three stages of n BasicBlocks with width, 2 and 4 x width channels (stride 2 at the
    start of the second and third), global average pooling and the linear classifier; depth = 6n + 2 weighted
    layers (20, 32, 44, 56, 110, ...). Where a block changes the shape its shortcut is a 1x1 convolution with
    GroupNorm (He et al.'s option B; their CIFAR figures use zero-padded identities, which have no parameters).

    GroupNorm has ceil(C / group_channels) groups, the rule of the ECL-ISVR code, but 8 channels per group rather
    than its 32: that code's network has 64 to 512 channels (2 to 16 groups), whereas 32 here would leave the 16-
    and 32-channel stages a single group, i.e. LayerNorm, which Wu and He (2018) found worse than GroupNorm. 8
    gives 2, 4 and 8 groups. No dropout by default, as in He et al.

    Any image size works: 32x32 gives stages of 32, 16 and 8 pixels a side, 28x28 gives 28, 14 and 7.
    """
    if not (isinstance(depth, int) and depth >= 8 and (depth - 2) % 6 == 0):
        raise ValueError(f"resnet-cifar: depth must be 6n + 2 for n >= 1 (8, 14, 20, 32, 44, 56, 110, ...), "
                         f"got {depth!r}")
    blocks = (depth - 2) // 6
    return _resnet("resnet-cifar", input_shape, num_classes, (blocks, blocks, blocks), width, group_channels,
                   dropout_conv, dropout_fc)


class _Attention(nn.Module):
    """Causal multi-head self-attention through PyTorch's scaled-dot-product attention (a fused kernel where the
    device has one)."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        self.qkv = nn.Linear(width, 3 * width)
        self.projection = nn.Linear(width, width)
        self.residual_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = (part.view(batch, length, self.heads, width // self.heads).transpose(1, 2)
                   for part in self.qkv(x).split(width, dim=2))
        y = nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                                       is_causal=True)
        return self.residual_dropout(self.projection(y.transpose(1, 2).reshape(batch, length, width)))


class _DecoderBlock(nn.Module):
    """Pre-norm transformer block: x + attention(norm(x)), then x + mlp(norm(x)) with a 4x GELU MLP."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attention = _Attention(width, heads, dropout)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width),
                                 nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """A decoder-only transformer (GPT-2's shape, as nanoGPT writes it): token and learned position embeddings,
    pre-norm blocks of causal self-attention and MLP, a final LayerNorm and the output layer, whose weights are
    the token embedding's (weight tying). Takes tokens (B, T) with T <= context_length; returns logits (B, T, V)."""

    def __init__(self, vocab_size: int, context_length: int, layers: int, heads: int, width: int,
                 dropout: float) -> None:
        super().__init__()
        self.context_length = context_length
        self.token_embedding = nn.Embedding(vocab_size, width)
        self.position_embedding = nn.Embedding(context_length, width)
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(_DecoderBlock(width, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)
        self.head.weight = self.token_embedding.weight
        # GPT-2's initialisation: N(0, 0.02), the projections into the residual stream scaled by 1/sqrt(2 layers).
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for block in self.blocks:
            for projection in (block.attention.projection, block.mlp[2]):
                nn.init.normal_(projection.weight, std=0.02 / math.sqrt(2 * layers))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.dropout(self.token_embedding(tokens) + self.position_embedding(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def gpt(input_shape: InputShape = (64,), num_classes: int = 256, layers: int = 2, heads: int = 4, width: int = 128,
        context_length: int | None = None, dropout: float = 0.0) -> nn.Module:
    """A small GPT for a language model's data: `layers` blocks of `heads` heads over `width` features, a context
    of `context_length` tokens (default: the data's sequence_length, which it must not be shorter than), dropout
    after the embeddings, in attention and on the residual branches. The vocabulary is the data's (num_classes).
    The default, 2 layers of width 128 over bytes, has about 0.44 M parameters."""
    if len(input_shape) != 1:
        raise ModelError(f"gpt needs token sequences (text or tokens data, task: language-model), but the dataset's "
                         f"samples have shape {tuple(input_shape)}")
    for name, value in (("layers", layers), ("heads", heads), ("width", width)):
        if isinstance(value, bool) or not (isinstance(value, int) and value > 0):
            raise ValueError(f"gpt: {name} must be a positive integer, got {value!r}")
    if width % heads:
        raise ValueError(f"gpt: width {width} must be a multiple of heads {heads}")
    if isinstance(dropout, bool) or not (isinstance(dropout, int | float) and 0 <= dropout < 1):
        raise ValueError(f"gpt: dropout must be in [0, 1), got {dropout!r}")
    sequence_length = input_shape[0]
    if context_length is None:
        context_length = sequence_length
    if isinstance(context_length, bool) or not isinstance(context_length, int) or context_length < sequence_length:
        raise ValueError(f"gpt: context_length must be an integer >= the data's sequence_length {sequence_length}, "
                         f"got {context_length!r}")
    return GPT(num_classes, context_length, layers, heads, width, float(dropout))

MODELS: dict[str, Callable[..., nn.Module]] = {
    "logistic": logistic,
    "mlp": mlp,
    "cnn": cnn,
    "resnet-gn": resnet_gn,
    "resnet-cifar": resnet_cifar,
    "gpt": gpt,
}


_IDENTIFIER = r"[A-Za-z_][A-Za-z0-9_]*"
_MODULE = re.compile(rf"{_IDENTIFIER}(?:\.{_IDENTIFIER})*")
_IMPORT_PATH = re.compile(rf"(?P<module>{_MODULE.pattern}):(?P<factory>{_IDENTIFIER})")


def is_import_path(name: str) -> bool:
    """Whether a job's model name is a user's factory ('package.module:factory') rather than a registry name."""
    return ":" in name


def module_problem(module: str) -> str | None:
    """Why a model can never come from `module` (None: it may, where an operator allows it): not a dotted name of
    identifiers, or a module of Python's standard library, which holds no models but runs commands (os:system)."""
    if not _MODULE.fullmatch(module):
        return f"{module!r} is not a module name (identifiers joined by dots)"
    if module.partition(".")[0] in sys.stdlib_module_names:
        return f"{module} is Python's standard library, never a model's module"
    return None


def _split_import_path(path: str) -> tuple[str, str]:
    """(module, factory) of 'package.module:factory', checked without importing anything; ModelError otherwise."""
    match = _IMPORT_PATH.fullmatch(path)
    if match is None:
        raise ModelError(f"model {path!r}: an import path must read 'package.module:factory' (identifiers)")
    problem = module_problem(match["module"])
    if problem:
        raise ModelError(f"model {path!r}: {problem}")
    return match["module"], match["factory"]


def _import_factory(path: str, allow_imports: Collection[str]) -> Callable[..., nn.Module]:
    """The factory of an import path, imported only if its module is exactly one of `allow_imports`: allowing a
    package allows none of its submodules, which its operator may never have read. The factory must be defined in
    that module, so that what the module merely imports (`from subprocess import run`) cannot be called."""
    module_name, attribute = _split_import_path(path)
    if module_name not in allow_imports:
        raise ModelError(
            f"model {path!r}: module {module_name} is not allowed on this machine; its operator allows it with "
            f"--allow-import {module_name} (nodeagent serve, coordinator simulate)"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ModelError(f"model {path!r}: cannot import {module_name}: {error}") from error
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise ModelError(f"model {path!r}: {module_name} has no callable named {attribute!r}")
    if getattr(factory, "__module__", None) != module_name:
        raise ModelError(f"model {path!r}: {attribute} is not defined in {module_name} but imported into it; name "
                         "the module that defines it")
    return factory


def build_model(spec: ModelSpec, input_shape: InputShape = (1, 28, 28), num_classes: int = 10,
                allow_imports: Collection[str] = ()) -> nn.Module:
    """Builds the model a job names: a registry name, or a user's factory as 'package.module:factory' from one of
    the modules in `allow_imports` (none by default: see the module's docstring).

    The factory is called with spec.options as keyword arguments, plus input_shape and num_classes when its
    signature accepts them. Raises ModelError for an unknown name, an option the factory does not take, a module
    not allowed, or an import that fails; the factory itself may raise ValueError for an option's value.
    """
    factory = _import_factory(spec.name, allow_imports) if is_import_path(spec.name) else _registered(spec)
    kwargs = _arguments(spec, factory, input_shape, num_classes)
    model = factory(**kwargs)
    if not isinstance(model, nn.Module):
        raise ModelError(f"model {spec.name!r}: the factory returned {type(model).__name__}, not a torch.nn.Module")
    return model


def seeded_model(spec: JobSpec, info: DatasetInfo, allow_imports: Collection[str] = ()) -> nn.Module:
    """The job's model as its seed initialises it, shaped for the data `info` describes. It seeds torch's global
    generator with the job's seed, so that what a node draws next (dropout) is the same on every run; a caller that
    must keep its own random state forks it first."""
    torch.manual_seed(spec.seed)
    return build_model(spec.model, info.input_shape, info.num_classes, allow_imports)


def initial_model(spec: JobSpec, info: DatasetInfo, allow_imports: Collection[str] = ()) -> nn.Module:
    """The job's initial model, identical on every node and at the parameter server: the seeded one, with the
    parameters of the job's `model.init` file where it names one (ModelError if that file does not fit)."""
    model = seeded_model(spec, info, allow_imports)
    if spec.model.init is not None:
        try:
            load_parameters(model, Path(spec.model.init))
        except ModelFileError as error:
            raise ModelError(f"model.init {error}") from None
    return model


def check_model(spec: ModelSpec, input_shape: InputShape, num_classes: int) -> nn.Module | None:
    """What can be known of a job's model without its data, nor importing a user's code (whether an import path
    is allowed and fits is the agents' to check): an import path's form; a registry model's name and options,
    names and values, by building it for samples of `input_shape` in `num_classes` classes (the task's nominal
    data: the data's own is known where the data is) on the meta device, which allocates nothing and draws no
    random numbers. Returns that model (its sizes are those of the job's where the task's nominal data is the job's),
    or None for an import path. ValueError (ModelError for a name or option the factory does not take) naming the
    problem."""
    if is_import_path(spec.name):
        _split_import_path(spec.name)
        return None
    factory = _registered(spec)
    kwargs = _arguments(spec, factory, input_shape, num_classes)
    with torch.device("meta"):
        return factory(**kwargs)


def _registered(spec: ModelSpec) -> Callable[..., nn.Module]:
    if spec.name not in MODELS:
        known = ", ".join(MODELS)
        raise ModelError(f"unknown model {spec.name!r}; known: {known}, or 'package.module:factory'")
    return MODELS[spec.name]


def _arguments(spec: ModelSpec, factory: Callable[..., nn.Module], input_shape: InputShape,
               num_classes: int) -> dict[str, object]:
    """The factory's keyword arguments: the job's options, and the data's shape and classes where it takes them."""
    signature = inspect.signature(factory)
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
    kwargs = dict(spec.options)
    for name, value in (("input_shape", tuple(input_shape)), ("num_classes", num_classes)):
        if name in spec.options:
            raise ModelError(f"model {spec.name!r}: {name} comes from the dataset and cannot be an option")
        if takes_any or name in signature.parameters:
            kwargs[name] = value
    try:
        signature.bind(**kwargs)
    except TypeError as error:
        raise ModelError(f"model {spec.name!r}: options {shown(sorted(spec.options))} do not fit: "
                         f"{clip(str(error), MAX_SHOWN_CHARS)}") from None
    return kwargs


def flat_parameters(model: nn.Module) -> torch.Tensor:
    """A copy of the trainable parameters as one flat vector, in named_parameters() order."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters() if p.requires_grad])


def parameter_specs(model: nn.Module) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(name, dtype, shape) of each trainable parameter: what nodes exchange. Buffers are not exchanged."""
    return [(name, p.dtype, tuple(p.shape)) for name, p in model.named_parameters() if p.requires_grad]
