"""npu_dumper.capture.opschema: the op schema facts every mode reads (argument names, writes,
out=, views, tags), the only copy."""

from __future__ import annotations

import pytest
import torch

from npu_dumper.capture import opschema, snapshots, walk


def test_the_dump_mode_reads_schema_facts_from_opschema():
    # one place: the dump's hot path uses opschema's functions, and snapshots keeps no copy
    assert walk.op_info is opschema.op_info
    assert not hasattr(snapshots, "HIDDEN_WRITES") and not hasattr(snapshots, "op_info")


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
