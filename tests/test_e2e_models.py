"""End to end, for every sample model (tiny sizes): dump, replay, compare, verdict, overflow.

Each model's golden dump is made once per module. Fault sites and overflow sites are
chosen from the dump (not from op names we know the models use), so these tests hold
for any model added to the registry.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

import sample_models
from accucmp.cli.main import app
from accucmp.compare.pipeline import compare_dumps
from accucmp.demo_fault import pick_fault_site
from accucmp.compare.verdict import apply_verdict
from accucmp.report.findings import first_failure
from dumpfile.read.reader import DumpFile
from npu_dumper import dumper
from npu_dumper.replay.emulation import emulate_npu, inject_fault, is_cube_op
from npu_dumper.replay.op_names import resolve_op

MODELS = sample_models.names()
SIZE = sample_models.TINY



def run_step(name: str, path, *, below=(), **dumper_kwargs) -> None:
    """One training step of `name` inside dumper(**kwargs), with `below` entered first."""
    spec = sample_models.get(name)
    model, inputs = spec.build(seed=0, size=SIZE), spec.make_inputs(seed=0, size=SIZE)
    with contextlib.ExitStack() as stack:
        for cm in below:
            stack.enter_context(cm)
        with dumper(dump_path=str(path), **dumper_kwargs):
            spec.train_step(model, inputs)


def judged(target, golden) -> pd.DataFrame:
    return apply_verdict(compare_dumps(str(target), str(golden)).table)


def failing_ops(table) -> set[tuple[str, int]]:
    failed = table[table["Result"] == "fail"]
    return {(str(r.NPUDump), int(r.SeqId)) for r in failed.itertuples()}


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    made = {}

    def get(name):
        if name not in made:
            path = tmp_path_factory.mktemp(f"e2e_{name}") / "golden.h5"
            run_step(name, path)
            made[name] = path
        return made[name]
    return get


@pytest.mark.parametrize("name", MODELS)
def test_two_dumps_of_one_run_compare_identical_and_exit_0(name, golden, tmp_path, monkeypatch):
    again = tmp_path / "again.h5"
    run_step(name, again)
    monkeypatch.setenv("COLUMNS", "120")
    result = CliRunner().invoke(app, ["compare", "-m", str(again), "-g", str(golden(name)),
                                      "-o", str(tmp_path), "-q"])
    assert result.exit_code == 0, result.output
    table = judged(again, golden(name))
    compared = table[table["CompareStatus"] == "compared"]
    assert len(compared) > 10
    assert (pd.to_numeric(compared["CosineSimilarity"]) == 1).all()
    assert (pd.to_numeric(compared["MaxAbsoluteError"]) == 0).all()
    assert set(table["Result"]) <= {"pass", "skipped"}


@pytest.mark.parametrize("name", MODELS)
def test_emulated_npu_replay_differs_only_in_cube_ops_and_passes(name, golden, tmp_path):
    target = tmp_path / "npu.h5"
    run_step(name, target, below=[emulate_npu()], use_load=True, load_file_path=str(golden(name)))
    table = judged(target, golden(name))
    assert (table["Result"] == "fail").sum() == 0, table[table["Result"] == "fail"].to_string()
    differing = table[pd.to_numeric(table["MaxAbsoluteError"], errors="coerce") > 0]
    assert not differing.empty, "the emulation changed nothing"
    # Only cube ops' results differ, all recorded as computed in float16, at float16 level.
    assert all(is_cube_op(resolve_op(op)) for op in differing["NPUDump"])
    assert set(differing["IO"]) == {"output"}
    assert (differing["ComputeDtype"] == "float16").all()
    red = pd.to_numeric(differing["RelativeEuclideanDistance"])
    assert (red < 64 * 2.0 ** -11).all()
    # Non-cube ops, replayed from the golden inputs, agree exactly.
    others = table[~table["NPUDump"].isin(set(differing["NPUDump"]))]
    assert (pd.to_numeric(others["MaxAbsoluteError"], errors="coerce").fillna(0) == 0).all()


@pytest.mark.parametrize("name", MODELS)
def test_injected_fault_is_the_only_failure_under_load_replay(name, golden, tmp_path):
    site = pick_fault_site(golden(name))
    assert not is_cube_op(resolve_op(site.op))
    target = tmp_path / "faulty_npu.h5"
    run_step(name, target, below=[emulate_npu(), inject_fault(site.op, rel=0.05, call=site.call)],
             use_load=True, load_file_path=str(golden(name)))
    table = judged(target, golden(name))
    assert failing_ops(table) == {(site.op, site.seqid)}
    ff = first_failure(table)
    assert (ff["NPUDump"], int(ff["SeqId"])) == (site.op, site.seqid)
    assert ff["IO"] == "output"


@pytest.mark.parametrize("name", MODELS)
def test_injected_fault_is_the_first_failure_in_a_plain_compare(name, golden, tmp_path):
    site = pick_fault_site(golden(name))
    target = tmp_path / "faulty.h5"
    run_step(name, target, below=[inject_fault(site.op, rel=0.05, call=site.call)])
    table = judged(target, golden(name))
    ff = first_failure(table)
    assert ff is not None
    assert (ff["NPUDump"], int(ff["SeqId"])) == (site.op, site.seqid)
    # The error spreads: later ops fail too, which is why the first failure matters.
    assert len(failing_ops(table)) > 1


def first_forward_cube_op(golden_path) -> tuple[str, int]:
    with DumpFile(golden_path) as df:
        for rec in df.ops():
            func = resolve_op(rec.op)
            if rec.phase == "forward" and func is not None and is_cube_op(func):
                return rec.op, rec.seqid
    raise AssertionError(f"{golden_path}: no forward cube op")


@pytest.mark.parametrize("name", MODELS)
def test_overflow_check_finds_an_overflow_planted_in_float16(name, golden, tmp_path, capsys):
    op, seqid = first_forward_cube_op(golden(name))
    # The first cube op's result is scaled by ~1e6 inside the emulation, which then
    # rounds it to float16: values beyond 65504 become inf, as on the device.
    plant = inject_fault(op, rel=1e6, call=1)
    overflow = tmp_path / "overflow.h5"
    run_step(name, overflow, below=[plant, emulate_npu()], check_overflow=True)
    assert f"IR: {op} SeqId: {seqid} is overflow!" in capsys.readouterr().out
    with DumpFile(overflow) as df:
        ops = df.ops()
        assert (ops[0].op, ops[0].seqid) == (op, seqid)
        out = next(iter(ops[0].outputs().values()))
        assert np.isinf(out.read()).any()
    # Without the plant the same emulated run has no overflow at all.
    clean = tmp_path / "clean.h5"
    run_step(name, clean, below=[emulate_npu()], check_overflow=True)
    with DumpFile(clean) as df:
        assert len(df.ops()) == 0
