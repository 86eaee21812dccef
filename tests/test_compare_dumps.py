"""compare_dumps on dumps written with dumpfile.DumpWriter (no torch)."""

import subprocess
import sys

import h5py
import numpy as np
import pytest

from accucmp.compare.pipeline import CompareError, compare_dumps
from accucmp.compare.verdict import apply_verdict
from accucmp.report.findings import first_failure
from dumpfile import DumpFormatError
from dumpfile import schema as S
from tests._compare_helpers import bf16, write_dump

RNG = np.random.default_rng(3)


def model_ops(n=6, scale_fault_at=None, dtype="float32"):
    """A chain of linear-ish ops; each output feeds the next op's input."""
    ops = []
    h = RNG.standard_normal((8, 16)).astype(np.float32)
    for i in range(1, n + 1):
        w = RNG.standard_normal((16, 16)).astype(np.float32) / 4
        out = (h.astype(np.float64) @ w).astype(np.float32)
        ops.append(dict(op="aten.mm.default" if i % 2 else "aten.gelu.default", seqid=i, module=f"layers.{i}",
                        phase="forward" if i <= n // 2 else "backward",
                        inputs={"self": h, "mat2": w}, outputs={"result": out}))
        h = out
    return ops


def to_dtype(ops, dtype, fault_at=None, factor=1.05):
    out = []
    for o in ops:
        o = dict(o, inputs=dict(o["inputs"]), outputs=dict(o["outputs"]))
        for grp in ("inputs", "outputs"):
            for k, v in o[grp].items():
                v = v * factor if (grp == "outputs" and o["seqid"] == fault_at) else v
                o[grp][k] = (bf16(v), "bfloat16") if dtype == "bfloat16" else v.astype(np.float32)
        out.append(o)
    return out


@pytest.fixture
def pair(tmp_path):
    ops = model_ops()
    write_dump(tmp_path / "g.h5", ops)
    return tmp_path, ops


def test_perturbed_op_is_the_first_failure(pair):
    d, ops = pair
    write_dump(d / "t.h5", to_dtype(ops, "bfloat16", fault_at=4), mode=S.MODE_LOAD)
    res = compare_dumps(d / "t.h5", d / "g.h5")
    t = apply_verdict(res.table)
    assert res.meta["pairing"] == "seqid"
    assert len(t) == 18 and list(t["SeqId"]) == sorted(t["SeqId"])
    ff = first_failure(t)
    assert ff["SeqId"] == 4 and ff["IO"] == "output" and ff["Module"] == "layers.4"
    # the clean bf16 rows pass: bf16 rounding alone is not a failure
    clean = t[t["SeqId"] != 4]
    assert (clean["Result"] == "pass").all(), clean[["NPUDumpPath", "FailReason"]]
    assert (t["PrecisionDtype"] == "bfloat16").all()
    assert set(t["DataType"]) == {"bfloat16"} and set(t["GoldenDataType"]) == {"float32"}


def test_jobs_and_chunking_do_not_change_numbers(pair):
    d, ops = pair
    write_dump(d / "t.h5", to_dtype(ops, "bfloat16"))
    a = compare_dumps(d / "t.h5", d / "g.h5").table
    b = compare_dumps(d / "t.h5", d / "g.h5", jobs=2, chunk_elements=7).table
    num = a.select_dtypes("number").columns
    np.testing.assert_allclose(a[num].to_numpy(float), b[num].to_numpy(float), rtol=1e-7, equal_nan=True)
    assert list(a["StandardDeviation"]) == list(b["StandardDeviation"])


def test_select_and_unmatched_rows_on_both_sides(tmp_path):
    ops = model_ops(4)
    write_dump(tmp_path / "g.h5", ops)
    extra = dict(op="aten.relu.default", seqid=99, inputs={"self": ops[0]["outputs"]["result"]},
                 outputs={"result": ops[0]["outputs"]["result"]})
    t_ops = [ops[0], extra] + [dict(o, seqid=o["seqid"] + 100) for o in ops[1:3]]   # last golden op missing
    write_dump(tmp_path / "t.h5", t_ops)
    res = compare_dumps(tmp_path / "t.h5", tmp_path / "g.h5")
    t = apply_verdict(res.table)
    assert res.meta["unmatched_target_ops"] == 1 and res.meta["unmatched_golden_ops"] == 1
    un = t[t["Result"] == "unmatched"]
    assert set(un["NPUDump"]) == {"aten.relu.default", "aten.gelu.default"}
    assert any("in golden dump data" in r for r in un["CompareFailReason"])
    assert any("in my dump data" in r for r in un["CompareFailReason"])
    assert (t[t["Result"] != "unmatched"]["Result"] == "pass").all()
    sel = compare_dumps(tmp_path / "t.h5", tmp_path / "g.h5", select=r"gelu").table
    assert set(sel["NPUDump"]) == {"aten.gelu.default"}
    with pytest.raises(CompareError):
        compare_dumps(tmp_path / "t.h5", tmp_path / "g.h5", select="(")


def test_bad_tensors_become_rows_with_reasons(tmp_path):
    y = RNG.standard_normal((4, 4)).astype(np.float32)
    g_ops = [dict(op=f"aten.op{i}.default", seqid=i, outputs={"result": y}) for i in range(1, 7)]
    t_vals = [y.copy(), y[:3].copy(), np.full_like(y, np.nan), np.zeros_like(y), y.astype(np.float16), y.copy()]
    t_ops = [dict(op=f"aten.op{i}.default", seqid=i, outputs={"result": v}) for i, v in enumerate(t_vals, 1)]
    t_ops[5]["uninitialized"] = True
    write_dump(tmp_path / "g.h5", g_ops)
    write_dump(tmp_path / "t.h5", t_ops)
    with h5py.File(tmp_path / "t.h5", "a") as f:   # op1: shape attribute lies about the data
        f["/aten.op1.default/1/output/result"].attrs[S.ATTR_SHAPE] = np.array([5, 5])
        del f[S.CATALOG_PATH]       # an in-place edit drops the catalog (docs/FORMAT.md "The catalog")
    t = apply_verdict(compare_dumps(tmp_path / "t.h5", tmp_path / "g.h5").table)
    by = {r["NPUDump"].split(".")[1]: r for r in t.to_dict("records")}
    assert by["op1"]["CompareStatus"] == "corrupt" and "disagrees with the stored data" in by["op1"]["CompareFailReason"]
    assert by["op2"]["CompareStatus"] == "size_mismatch" and by["op2"]["Result"] == "fail"
    assert by["op3"]["Result"] == "fail" and "NaN/Inf on one side only" in by["op3"]["CompareFailReason"]
    assert by["op4"]["Result"] == "fail" and "target is all zero" in by["op4"]["CompareFailReason"]
    assert by["op5"]["Result"] == "pass" and by["op5"]["DataType"] == "float16"   # fp16 rounding only
    assert by["op6"]["Result"] == "skipped" and "empty-like" in by["op6"]["CompareFailReason"]
    assert by["op1"]["Result"] == "fail"


def test_statistics_only_dumps(tmp_path):
    def stats(scale):
        return {"stats": [-1.0 * scale, 2.0 * scale, 0.5 * scale, 1.0 * scale, 10.0 * scale, 0, 0, 100],
                "shape": (10, 10)}
    write_dump(tmp_path / "g.h5", [dict(op="aten.mm.default", seqid=1, outputs={"result": stats(1.0)}),
                                   dict(op="aten.mm.default", seqid=2, outputs={"result": stats(1.0)})],
               stats_only=True)
    write_dump(tmp_path / "t.h5", [dict(op="aten.mm.default", seqid=1, outputs={"result": stats(1.0)}),
                                   dict(op="aten.mm.default", seqid=2, outputs={"result": stats(1.1)})],
               stats_only=True)
    t = apply_verdict(compare_dumps(tmp_path / "t.h5", tmp_path / "g.h5").table)
    assert list(t["CompareStatus"]) == ["stats", "stats"]
    assert list(t["Result"]) == ["pass", "fail"]
    assert t["RelativeEuclideanDistance"][1] == pytest.approx(0.1)
    assert "lower bound" in t["CompareFailReason"][1]


def test_golden_fp64_columns(tmp_path):
    y64 = RNG.standard_normal(4096)
    g = y64.astype(np.float32)
    write_dump(tmp_path / "g.h5", [dict(op="aten.mm.default", seqid=1, outputs={"result": g})])
    write_dump(tmp_path / "f.h5", [dict(op="aten.mm.default", seqid=1, outputs={"result": y64})], mode=S.MODE_GOLDEN)
    write_dump(tmp_path / "t.h5", [dict(op="aten.mm.default", seqid=1, outputs={"result": (bf16(g), "bfloat16")})],
               mode=S.MODE_LOAD)
    t = apply_verdict(compare_dumps(tmp_path / "t.h5", tmp_path / "g.h5", golden_fp64=tmp_path / "f.h5").table)
    assert t["GoldenErrorVsFp64"][0] < 1e-7 < t["TargetErrorVsFp64"][0] < 2.0 ** -8
    assert t["Result"][0] == "pass"


def test_bad_files_raise_one_line_dump_errors(tmp_path):
    (tmp_path / "not.h5").write_text("hello")
    write_dump(tmp_path / "g.h5", model_ops(2))
    for bad in (tmp_path / "missing.h5", tmp_path / "not.h5"):
        with pytest.raises(DumpFormatError) as e:
            compare_dumps(bad, tmp_path / "g.h5")
        assert "\n" not in str(e.value) and str(bad) in str(e.value)
    with pytest.raises(CompareError):
        compare_dumps(tmp_path / "g.h5", tmp_path / "g.h5", algorithms=["Nope"])


def test_algorithm_subset(tmp_path):
    write_dump(tmp_path / "g.h5", model_ops(2))
    t = compare_dumps(tmp_path / "g.h5", tmp_path / "g.h5", algorithms=["CosineSimilarity"]).table
    assert "RelativeEuclideanDistance" not in t.columns and (t["CosineSimilarity"] == 1.0).all()
    assert (apply_verdict(t)["Result"] == "pass").all()


def test_import_does_not_load_torch():
    code = ("import sys, accucmp.compare.pipeline, accucmp.compare.verdict, accucmp.compare.matching, accucmp.compare.metrics; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
