"""A ShuffleNetV2-style net: channel split, depthwise conv, channel shuffle; cross-entropy.

The guide's tuning example; it exercises grouped/depthwise convolution and the
view/transpose/cat data movement that channel shuffle is made of.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .registry import FULL, TINY, ModelSpec, image_classification_inputs, register


def channel_shuffle(x: torch.Tensor, groups: int) -> torch.Tensor:
    b, c, h, w = x.shape
    x = x.view(b, groups, c // groups, h, w).transpose(1, 2).contiguous()
    return x.view(b, c, h, w)


def _conv_bn(cin, cout, kernel, stride=1, groups=1, relu=True):
    layers = [nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False),
              nn.BatchNorm2d(cout)]
    if relu:
        layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class ShuffleUnit(nn.Module):
    """Stride 1: split channels, transform one half. Stride 2: both branches downsample."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.stride = stride
        branch = cout // 2
        if stride == 1:
            assert cin == cout, "a stride-1 unit keeps the channel count"
            self.left = nn.Identity()
            right_in = cin // 2
        else:
            self.left = nn.Sequential(
                _conv_bn(cin, cin, 3, stride, groups=cin, relu=False),
                _conv_bn(cin, branch, 1))
            right_in = cin
        self.right = nn.Sequential(
            _conv_bn(right_in, branch, 1),
            _conv_bn(branch, branch, 3, stride, groups=branch, relu=False),
            _conv_bn(branch, branch, 1))

    def forward(self, x):
        if self.stride == 1:
            left, right = x.chunk(2, dim=1)
        else:
            left, right = x, x
        return channel_shuffle(torch.cat((self.left(left), self.right(right)), dim=1), 2)


class ShuffleNetV2Small(nn.Module):
    def __init__(self, stem: int = 16, widths: tuple[int, ...] = (32, 64), repeats: int = 2,
                 num_classes: int = 10):
        super().__init__()
        self.stem = _conv_bn(3, stem, 3, 2)
        units, cin = [], stem
        for width in widths:
            units.append(ShuffleUnit(cin, width, 2))
            units.extend(ShuffleUnit(width, width, 1) for _ in range(repeats - 1))
            cin = width
        self.units = nn.Sequential(*units)
        self.head = _conv_bn(cin, cin * 2, 1)
        self.fc = nn.Linear(cin * 2, num_classes)

    def forward(self, x):
        x = self.head(self.units(self.stem(x)))
        return self.fc(x.mean(dim=(2, 3)))


SPEC = register(ModelSpec(
    name="shufflenet",
    description="ShuffleNetV2-style net: channel split, depthwise conv, channel shuffle; cross-entropy",
    factory=ShuffleNetV2Small,
    inputs=image_classification_inputs,
    loss_fn=F.cross_entropy,
    configs={
        FULL: {"stem": 24, "widths": (48, 96, 192), "repeats": 2, "num_classes": 10, "input_hw": 32},
        TINY: {"stem": 8, "widths": (8, 16), "repeats": 2, "num_classes": 4, "input_hw": 16},
    },
    # Tiny keeps 2x2 maps in the last stage and 4 samples: BatchNorm over fewer values
    # makes gradients cancel to ~1e-9, pure rounding noise even in float32.
    default_batch={FULL: 16, TINY: 4},
    features=("convolution", "depthwise_convolution", "batch_norm", "channel_shuffle", "cat",
              "linear", "cross_entropy"),
))
