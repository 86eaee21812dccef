"""A small ResNet (basic blocks, BatchNorm, strided downsampling); cross-entropy loss.

The guide's ResNet50 example scaled down to what a CPU trains in well under a second.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .registry import FULL, TINY, ModelSpec, image_classification_inputs, register


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class SmallResNet(nn.Module):
    def __init__(self, width: int = 16, blocks: tuple[int, ...] = (1, 1, 1), num_classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        stages, cin = [], width
        for i, n in enumerate(blocks):
            cout = width * 2 ** i
            for j in range(n):
                stages.append(BasicBlock(cin, cout, stride=2 if (i > 0 and j == 0) else 1))
                cin = cout
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(self.pool(x), 1))


SPEC = register(ModelSpec(
    name="resnet",
    description="small ResNet: 3 stages of basic blocks with BatchNorm; cross-entropy loss",
    factory=SmallResNet,
    inputs=image_classification_inputs,
    loss_fn=F.cross_entropy,
    configs={
        FULL: {"width": 16, "blocks": (2, 2, 2), "num_classes": 10, "input_hw": 32},
        TINY: {"width": 4, "blocks": (1, 1), "num_classes": 4, "input_hw": 8},
    },
    default_batch={FULL: 16, TINY: 2},
    features=("convolution", "batch_norm", "relu", "adaptive_avg_pool", "linear", "cross_entropy"),
))
