"""One bf16 step of the tiny sample MLP with a planted fault: a bf16 addmm kernel in layers.3
that adds 0.5 to its result (a buggy low-precision kernel: correct when fed float32)."""
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import npu_dumper
from sample_models.registry import get

spec = get("mlp")
model = spec.build(seed=0, size="tiny")
x, target = spec.make_inputs(seed=0, size="tiny")
dtype = torch.float32 if "--fp32" in sys.argv else torch.bfloat16
model, x = model.to(dtype), x.to(dtype)
target = target.to(dtype) if target.is_floating_point() else target
faulty = model.get_submodule(sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else "layers.3")
inside = [False]
faulty.register_forward_pre_hook(lambda m, a: inside.__setitem__(0, True))
faulty.register_forward_hook(lambda m, a, o: inside.__setitem__(0, False))


class BuggyBf16Addmm(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if inside[0] and func is torch.ops.aten.addmm.default and args[1].dtype == torch.bfloat16:
            out = out + 0.5
        return out


with BuggyBf16Addmm(), npu_dumper.upcast_from_env(), torch.no_grad():
    loss = spec.loss(model(x).float(), target.float() if target.is_floating_point() else target)
print(f"loss={loss.float().item()!r}")
