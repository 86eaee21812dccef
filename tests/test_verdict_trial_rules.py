"""Verdict rules found by running the diagnosis on unseen third-party models
(benchmarks/real_models_trial.py, docs/COMPARE.md): synthetic rows, each rule and its limit."""

import numpy as np
import pandas as pd

from accucmp.compare.op_policies import ORIGIN_CAUSED, ORIGIN_INHERITED
from accucmp.compare.verdict import apply_verdict
from tests._compare_helpers import bf16
from tests.test_compare_verdict import golden, row

F16_SUB = 2.0 ** -24


def _own(red, own, own_max, ref_max, *, dtype="float16", golden_absmax=None, seqid=1):
    """A load-replay output row judged by its own error (no tensors: the numbers only)."""
    return {"NPUDump": "aten.mm.default", "SeqId": seqid, "IO": "output", "TensorName": "result",
            "DataType": dtype, "GoldenDataType": "float32", "PrecisionDtype": dtype, "CompareStatus": "compared",
            "CompareFailReason": "", "NPUDumpPath": "/x", "GroundTruthPath": "/x",
            "RelativeEuclideanDistance": red, "MaxAbsoluteError": own_max, "CosineSimilarity": 1.0 - red,
            "GoldenAbsMax": ref_max if golden_absmax is None else golden_absmax,
            "OwnErrorVsFp64": own, "OwnMaxErrorVsFp64": own_max, "OwnRefAbsMax": ref_max}


def test_own_error_near_underflow_judged_at_the_formats_resolution():
    # max |ref| 5.9e-5 (float16 subnormal range): 5 spacings off everywhere is the format's
    # resolution; a 7% fault there is ~70 spacings at the largest element and still fails
    t = apply_verdict(pd.DataFrame([_own(0.019, 0.014, 5 * F16_SUB, 5.9e-5),
                                    _own(0.07, 0.07, 0.07 * 5.9e-5, 5.9e-5, seqid=2)]))
    assert list(t["Result"]) == ["pass", "fail"], t["FailReason"].tolist()
    assert "resolution" in t["FailReason"][0]
    # judged by its own error (the reference was rounded to float16, underflow included):
    # the fault is caused here, not excused as underflow
    assert t["Origin"][1] == ORIGIN_CAUSED and "underflow" not in t["FailReason"][1]


def test_own_error_after_input_rounding_that_left_no_correct_digit_is_not_judged():
    # a cancelling sum (0 in exact arithmetic): rounding its inputs alone moved it 6e4x its size
    t = apply_verdict(pd.DataFrame([_own(6.4e4, 3.6, 3.6e-7, 1e-7, dtype="bfloat16"),
                                    _own(0.5, 0.07, 0.07, 1.0, dtype="bfloat16", seqid=2)]))
    assert t["Result"][0] == "skipped" and "ill-conditioned" in t["FailReason"][0]
    assert t["Result"][1] == "fail"          # input rounding moved it by 43%: still judged


def _op(seqid, ins, out, dtype="bfloat16"):
    """rows of one op: (name, golden, target) inputs and output, as a plain dump pairs them."""
    rows = [dict(row(x, y, dtype=dtype, precision=dtype, seqid=seqid), IO="input", TensorName=n)
            for n, y, x in ins]
    rows.append(dict(row(out[1], out[0], dtype=dtype, precision=dtype, seqid=seqid), IO="output",
                     TensorName="result"))
    return rows


def _noisy(y, ulps):
    rng = np.random.default_rng(int(ulps * 100))
    return (y.astype(np.float64) * (1 + rng.standard_normal(y.size) * ulps * 2.0 ** -8)).astype(np.float32)


def test_origin_by_the_error_the_inputs_carry():
    y = golden()
    # inputs just under the bound (6 u of bfloat16), output just over: what they carried
    t = apply_verdict(pd.DataFrame(_op(1, [("self", y, _noisy(y, 5.5))], (y, _noisy(y, 6.5)))))
    out = t[t["IO"] == "output"].iloc[0]
    assert out["Result"] == "fail" and out["Origin"] == ORIGIN_INHERITED, out["FailReason"]
    # an input failing marginally (accumulated rounding) and an output 7% off: caused here
    t = apply_verdict(pd.DataFrame(_op(1, [("self", y, _noisy(y, 9))], (y, bf16(y * 1.07)))))
    out = t[t["IO"] == "output"].iloc[0]
    assert out["Origin"] == ORIGIN_CAUSED, out["FailReason"]
    # an input far beyond its bound (an upstream fault) that the op amplifies: inherited
    t = apply_verdict(pd.DataFrame(_op(1, [("self", y, bf16(y * 1.05))], (y ** 2, bf16((y * 1.05) ** 2)))))
    out = t[t["IO"] == "output"].iloc[0]
    assert out["Origin"] == ORIGIN_INHERITED, out["FailReason"]


def test_first_failure_prefers_an_underflow_op_to_inherited_rows():
    from accucmp.compare.op_policies import ORIGIN_UNDERFLOW
    from accucmp.report.findings import first_failure
    t = pd.DataFrame({"NPUDump": ["aten.native_layer_norm.default", "aten.mm.default", "aten.add.Tensor"],
                      "SeqId": [11, 65, 70], "IO": ["output"] * 3, "TensorName": ["result1", "result", "result"],
                      "Result": ["fail"] * 3, "Origin": [ORIGIN_INHERITED, ORIGIN_UNDERFLOW, ORIGIN_INHERITED]})
    assert first_failure(t)["NPUDump"] == "aten.mm.default"


def _as(op, rows):
    return [dict(r, NPUDump=op) for r in rows]


def test_a_collective_within_what_its_input_carries_passes_and_one_off_on_agreeing_inputs_fails():
    # DDP's gradient bucket under bf16 autocast (timm EfficientNet): the allreduce's output is
    # as far from the golden as this rank's input already was. Its own arithmetic (the other
    # ranks' inputs with it) is not measured, so it passes as inherited, as a measured op does.
    y = golden()
    carried = _op(1, [("tensors/tensors_0", y, _noisy(y, 5.5))], (y, _noisy(y, 6.5)))
    t = apply_verdict(pd.DataFrame(_as("c10d.allreduce_.default", carried)))
    out = t[t["IO"] == "output"].iloc[0]
    assert out["Result"] == "pass" and "collective" in out["FailReason"], out["FailReason"]
    # the same numbers at an op whose arithmetic is this rank's: still a failure, inherited
    t = apply_verdict(pd.DataFrame(_as("aten.add.Tensor", carried)))
    out = t[t["IO"] == "output"].iloc[0]
    assert out["Result"] == "fail" and out["Origin"] == ORIGIN_INHERITED
    # this rank's input agrees, the result does not (another rank's input differs): caused here
    t = apply_verdict(pd.DataFrame(_as("c10d.allreduce_.default",
                                       _op(1, [("tensors/tensors_0", y, y)], (y, bf16(y * 1.07))))))
    out = t[t["IO"] == "output"].iloc[0]
    assert out["Result"] == "fail" and out["Origin"] == ORIGIN_CAUSED
    assert "another rank's contribution differs" in out["FailReason"], out["FailReason"]
