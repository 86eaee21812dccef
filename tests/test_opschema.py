"""npu_dumper.opschema: the op schema facts every mode reads (argument names, writes,
out=, views, tags), and their agreement with the dump mode's copy in npu_dumper.capture."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from npu_dumper import capture, opschema


@pytest.fixture(scope="module")
def wide_ops():
    """Every op overload torch registers in aten, c10d, _c10d_functional, prims, quantized
    (collectives are registered late, with torch.distributed)."""
    import importlib
    try:
        importlib.import_module("torch.distributed")
    except Exception:  # noqa: BLE001 - a build without distributed
        pass
    ops = []
    for schema in torch._C._jit_get_all_schemas():
        ns, name = schema.name.split("::", 1)
        if ns not in ("aten", "c10d", "_c10d_functional", "prims", "quantized"):
            continue
        try:
            ops.append(getattr(getattr(getattr(torch.ops, ns), name), schema.overload_name or "default"))
        except (AttributeError, RuntimeError):
            continue
    assert len(ops) > 3000 and any(str(f).startswith("c10d.") for f in ops)
    return ops


def test_facts_agree_with_capture(wide_ops):
    compared = [f.name for f in dataclasses.fields(capture.OpInfo)]
    for func in wide_ops:
        a, b = capture.op_info(func), opschema.op_info(func)
        for name in compared:
            assert getattr(a, name) == getattr(b, name), (str(func), name)


def test_named_args_agree_with_capture(wide_ops):
    """Every prefix of positional arguments, with the keyword-only ones passed by name."""
    for func in wide_ops:
        a, b = capture.op_info(func), opschema.op_info(func)
        n_pos = sum(1 for k in b.kwarg_only if not k)
        kwargs = {n: f"kw:{n}" for n, k in zip(b.arg_names, b.kwarg_only) if k}
        for k in range(n_pos + 1):
            args = tuple(f"pos:{i}" for i in range(k))
            # the positional tail passed by name instead
            tail = {n: f"kw:{n}" for n in b.arg_names[k:n_pos]}
            for kw in (kwargs, {**kwargs, **tail}):
                assert capture.named_args(a, args, kw) == opschema.named_args(b, args, kw), str(func)
        out = tuple(range(len(b.return_names)))
        assert capture.named_returns(a, out) == opschema.named_returns(b, out), str(func)


def test_schema_facts():
    aten = torch.ops.aten
    bn = opschema.op_info(aten.native_batch_norm.default)
    assert {"running_mean", "running_var"} <= bn.written          # hidden writes
    assert not bn.schema_written
    add_out = opschema.op_info(aten.add.out)
    assert add_out.out_args == {"out"} and add_out.written == {"out"}
    assert opschema.op_info(aten.add_.Tensor).return_names == ("self",)
    assert add_out.not_data == {"out"}                             # recorded `uninitialized`
    assert opschema.op_info(aten.view.default).is_view
    assert not opschema.op_info(aten.add.Tensor).is_view
    assert opschema.op_info(aten.native_dropout.default).is_random
    assert not opschema.op_info(aten.mm.default).is_random
    mm = opschema.op_info(aten.mm.default)
    assert opschema.arg_dict(mm, (1,), {"mat2": 2}) == {"self": 1, "mat2": 2}
    sm = opschema.op_info(aten.sum.dim_IntList)
    assert sm.positions["dim"] == 1 and "dtype" not in sm.positions   # dtype is keyword-only
    assert sm.optional[sm.arg_names.index("dtype")]
    assert sm.has_default[sm.arg_names.index("keepdim")] and sm.defaults[sm.arg_names.index("keepdim")] is False


def test_register_op_amends_a_custom_op():
    lib = torch.library.Library("opschema_test", "DEF")
    lib.define("fused_norm(Tensor x, Tensor stats) -> Tensor")
    func = torch.ops.opschema_test.fused_norm.default
    assert opschema.op_info(func).written == frozenset()
    opschema.register_op(torch.ops.opschema_test.fused_norm, hidden_writes=("stats",), uninitialized=True)
    info = opschema.op_info(func)                 # the cached facts were dropped
    assert info.written == {"stats"} and info.uninitialized and not info.schema_written
