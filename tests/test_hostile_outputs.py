"""Issue 16, the output side: every command writes only new files in its output folder,
never through a link, within caps; a FIFO input cannot hang it; malformed kernel dumps,
acl.json files, empty dumps and header-only reports end with exit 2 and one line.

Each cell runs the real command in a subprocess with RLIMIT_AS = 2 GB and a timeout, and
asserts: the exit code, exactly one line on stderr that names the file, no traceback,
no byte of a marker file leaked into any output, the marker and the files a link points
to untouched, and nothing written outside the output folder.
"""

from __future__ import annotations

import os
import resource
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dumpfile import schema as S
from dumpfile.errors import DumpWriteError
from dumpfile.safe_output import NameSet, OutputBudget, new_dir, open_output, output_path, parse_size
from ir2tbe import dump_data as D
from ir2tbe.dump_data import TensorToWrite, write_kernel_dump

from ._cli_helpers import model_ops, perturbed, write_dump

ROOT = Path(__file__).resolve().parents[1]
# subprocess time limits are hang guards only: under load 3-12 one cell took over 30 s
HANG_GUARD = 600
MARKER = b"MARKER-c1153f0e-do-not-copy-"
AS_LIMIT = 2 << 30
KNAME = "Pooling.pool1.1.0.1589195081588018"


def _limit():
    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))


def run(tool: str, *args: str, cwd: Path, timeout: float = HANG_GUARD) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "160", "NO_COLOR": "1"}
    env.pop("ACCUCMP_DEBUG", None)
    env.pop("IR2TBE_DEBUG", None)
    return subprocess.run([sys.executable, "-m", f"{tool}.cli", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, timeout=timeout, preexec_fn=_limit, stdin=subprocess.DEVNULL)


def _snapshot(root: Path, skip: Path | None) -> dict[str, tuple[int, int]]:
    out = {}
    for dirpath, dirs, files in os.walk(root):
        if skip is not None and Path(dirpath).resolve() == skip.resolve():
            dirs[:] = []
            continue
        for n in files + [d for d in dirs if os.path.islink(os.path.join(dirpath, d))]:
            p = os.path.join(dirpath, n)
            st = os.lstat(p)
            out[os.path.relpath(p, root)] = (st.st_size, st.st_mtime_ns)
    return out


class Cell:
    """A work folder with a marker file; `out/` is the output folder."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.out = tmp / "out"
        self.marker = tmp / "secret.txt"
        self.marker.write_bytes(MARKER * 64)
        self.elsewhere = tmp / "elsewhere"
        self.elsewhere.mkdir()
        self.before: dict | None = None

    def freeze(self):
        self.before = _snapshot(self.tmp, self.out)

    def check(self, r: subprocess.CompletedProcess, code: int, names: str | None, *, lines: int | None = 1):
        err = r.stderr.decode("utf-8", "replace")
        assert r.returncode == code, (r.returncode, err, r.stdout[-2000:])
        assert "Traceback" not in err, err
        if lines is not None:
            assert len(err.strip().splitlines()) == lines, err
        if names is not None:
            assert names in err, err
        assert self.marker.read_bytes() == MARKER * 64
        assert list(self.elsewhere.iterdir()) == []
        if self.before is not None:   # nothing written (or changed) outside out/
            assert _snapshot(self.tmp, self.out) == self.before
        for dirpath, _, files in os.walk(self.out):
            for n in files:
                p = os.path.join(dirpath, n)
                if not os.path.islink(p):
                    assert MARKER not in Path(p).read_bytes(), p


@pytest.fixture
def cell(tmp_path):
    return Cell(tmp_path)


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    d = tmp_path_factory.mktemp("dumps")
    ops = model_ops(seed=0, n_layers=1, width=4, batch=2)
    golden = write_dump(d / "golden.h5", ops)
    faulty = write_dump(d / "faulty.h5", perturbed(ops, 2, 0.5), mode=S.MODE_LOAD)
    empty = write_dump(d / "empty.h5", [])
    return Path(golden), Path(faulty), Path(empty)


def _kernel_dump(path: Path, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((2, 3)).astype(np.float32)
    write_kernel_dump(path, "pool1", [TensorToWrite(x)], [TensorToWrite(np.maximum(x, 0))])
    return x


def _hand_built(path: Path, entries, payload: bytes = b"") -> Path:
    msg = D.DumpData(version="2.0", dump_time=1, op_name="pool1")
    for dt, shape, size in entries:
        e = msg.input.add()
        e.data_type, e.format, e.size = dt, D.FORMAT_ND, size
        e.shape.dim.extend(shape)
    header = msg.SerializeToString()
    path.write_bytes(struct.pack("<Q", len(header)) + header + payload)
    return path


# ---- compare / report -------------------------------------------------------------
def test_compare_p_never_writes_through_links_named_like_its_outputs(cell, dumps):
    """result_{stamp}.csv and failed_{stamp}/ planted as links for the coming seconds:
    compare picks other names, writes nothing through them."""
    golden, faulty, _ = dumps
    cell.out.mkdir()
    now = time.time()
    for t in range(-1, 40):
        stamp = time.strftime("%Y%m%d%H%M%S", time.localtime(now + t))
        os.symlink(cell.marker, cell.out / f"result_{stamp}.csv")
        os.symlink(cell.marker, cell.out / f"result_{stamp}_failed.csv")
        os.symlink(cell.elsewhere, cell.out / f"failed_{stamp}")
    cell.freeze()
    r = run("accucmp", "compare", "-m", faulty, "-g", golden, "-o", cell.out, "-p", "-q", cwd=cell.tmp)
    cell.check(r, 1, None, lines=None)
    npys = [p for p in cell.out.rglob("*.npy")]
    assert npys and all(not os.path.islink(p.parent) for p in npys)


def test_compare_p_caps_files(cell, dumps):
    golden, faulty, _ = dumps
    cell.freeze()
    r = run("accucmp", "compare", "-m", faulty, "-g", golden, "-o", cell.out, "-p", "-q", "--max-files", "1",
            cwd=cell.tmp)
    cell.check(r, 2, "--max-files")
    assert not list(cell.out.rglob("*.npy"))


@pytest.mark.parametrize("side", ["-m", "-g"])
def test_compare_of_an_empty_dump_is_an_error(cell, dumps, side):
    golden, faulty, empty = dumps
    args = ["-m", empty, "-g", golden] if side == "-m" else ["-m", faulty, "-g", empty]
    cell.freeze()
    r = run("accucmp", "compare", *args, "-o", cell.out, "-q", cwd=cell.tmp)
    cell.check(r, 2, str(empty))
    assert "no op" in r.stderr.decode()


def test_report_on_header_only_csv_is_an_error(cell):
    csv = cell.tmp / "result_1.csv"
    csv.write_text("Index,NPUDump,NPUDumpPath,GroundTruthPath,Result\n")
    cell.freeze()
    r = run("accucmp", "report", csv, "-q", cwd=cell.tmp)
    cell.check(r, 2, str(csv))


@pytest.mark.parametrize("kind", ["fifo", "directory", "binary"])
def test_report_on_a_non_csv_is_one_line(cell, kind):
    csv = cell.tmp / "result_1.csv"
    if kind == "fifo":
        os.mkfifo(csv)
    elif kind == "directory":
        csv.mkdir()
    else:
        csv.write_bytes(b"\x00\xff\xfe" + MARKER)
    cell.freeze()
    r = run("accucmp", "report", csv, "-q", cwd=cell.tmp)
    cell.check(r, 2, str(csv))


def test_report_writes_beside_a_planted_link_not_through_it(cell, dumps):
    golden, faulty, _ = dumps
    run("accucmp", "compare", "-m", faulty, "-g", golden, "-o", cell.out, "-q", cwd=cell.tmp)
    csv = next(cell.out.glob("result_*.csv"))
    os.symlink(cell.marker, cell.out / f"{csv.stem}_rethreshold.csv")
    os.symlink(cell.marker, cell.out / f"{csv.stem}_rethreshold.json")
    cell.freeze()
    r = run("accucmp", "report", csv, "-t", "CosineSimilarity=0.5", "-f", "json", "-q", cwd=cell.tmp)
    cell.check(r, r.returncode, None, lines=0)
    assert r.returncode in (0, 1)
    assert (cell.out / f"{csv.stem}_rethreshold_1.json").is_file()


# ---- golden -----------------------------------------------------------------------
def test_golden_refuses_an_output_link_and_an_existing_file(cell, dumps):
    golden, _, _ = dumps
    link = cell.tmp / "golden_out.h5"
    os.symlink(cell.marker, link)
    cell.freeze()
    r = run("accucmp", "golden", "-i", golden, "-o", link, "--no-progress", cwd=cell.tmp)
    cell.check(r, 2, str(link))
    assert "--force" in r.stderr.decode() and os.path.islink(link)


def test_golden_of_an_empty_dump_is_an_error(cell, dumps):
    _, _, empty = dumps
    cell.out.mkdir()
    cell.freeze()
    r = run("accucmp", "golden", "-i", empty, "-o", cell.out / "g.h5", "--no-progress", cwd=cell.tmp,
            timeout=HANG_GUARD)
    cell.check(r, 2, str(empty))
    assert list(cell.out.iterdir()) == []      # no golden, no temporary left


# ---- convert ------------------------------------------------------------------------
def test_convert_refuses_a_planted_link_and_force_replaces_the_link_only(cell):
    src = cell.tmp / KNAME
    _kernel_dump(src)
    cell.out.mkdir()
    link = cell.out / f"{KNAME}.input.0.npy"
    os.symlink(cell.marker, link)
    cell.freeze()
    r = run("accucmp", "convert", "-d", src, "-out", cell.out, cwd=cell.tmp)
    cell.check(r, 2, str(link))
    r = run("accucmp", "convert", "-d", src, "-out", cell.out, "--force", cwd=cell.tmp)
    cell.check(r, 0, None, lines=0)
    assert not os.path.islink(link) and np.load(link).shape == (2, 3)


def test_convert_same_base_name_from_two_folders_keeps_both(cell):
    a, b = cell.tmp / "a", cell.tmp / "b"
    a.mkdir(), b.mkdir()
    xa, xb = _kernel_dump(a / KNAME, 1), _kernel_dump(b / KNAME, 2)
    cell.freeze()
    r = run("accucmp", "convert", "-d", f"{a},{b}", "-out", cell.out, cwd=cell.tmp)
    cell.check(r, 0, None, lines=0)
    got = [np.load(cell.out / f"{n}.input.0.npy") for n in (KNAME, f"{KNAME}~1")]
    assert {g.tobytes() for g in got} == {xa.tobytes(), xb.tobytes()}


def test_convert_refuses_a_fifo_without_hanging(cell):
    fifo = cell.tmp / KNAME
    os.mkfifo(fifo)
    cell.freeze()
    r = run("accucmp", "convert", "-d", fifo, "-out", cell.out, cwd=cell.tmp)
    cell.check(r, 2, str(fifo))
    assert "FIFO" in r.stderr.decode()


@pytest.mark.parametrize("dims", [[0, 1 << 62], [1 << 40, 1 << 40, 0], [(1 << 63) - 1, 0]])
def test_convert_huge_dims_one_line(cell, dims):
    src = _hand_built(cell.tmp / KNAME, [(1, dims, 0)])
    cell.freeze()
    r = run("accucmp", "convert", "-d", src, "-out", cell.out, cwd=cell.tmp)
    cell.check(r, 2, str(src))


def test_convert_caps_files_and_bytes(cell):
    many = _hand_built(cell.tmp / KNAME, [(1, [0], 0)] * 300)
    cell.freeze()
    r = run("accucmp", "convert", "-d", many, "-out", cell.out, "--max-files", "100", cwd=cell.tmp)
    cell.check(r, 2, "--max-files")
    assert not list(cell.out.glob("*.npy"))
    big = cell.tmp / "big"
    big.mkdir()
    _kernel_dump(big / KNAME)
    cell.freeze()
    r = run("accucmp", "convert", "-d", big / KNAME, "-out", cell.out, "--max-bytes", "100", cwd=cell.tmp)
    cell.check(r, 2, "--max-bytes")
    assert not list(cell.out.glob("*.npy"))


# ---- extract ------------------------------------------------------------------------
def test_extract_refuses_an_output_link(cell, dumps):
    golden, _, _ = dumps
    cell.out.mkdir()
    link = cell.out / "small.h5"
    os.symlink(cell.marker, link)
    cell.freeze()
    r = run("accucmp", "extract", "-i", golden, "-o", link, "-s", "/aten.add.Tensor/", cwd=cell.tmp)
    cell.check(r, 2, str(link))
    assert os.path.islink(link)


def test_extract_caps_bytes(cell, dumps):
    golden, _, _ = dumps
    cell.out.mkdir()
    cell.freeze()
    out = cell.out / "small.h5"
    r = run("accucmp", "extract", "-i", golden, "-o", out, "-s", "/aten.add.Tensor/", "--max-bytes", "8",
            cwd=cell.tmp)
    cell.check(r, 2, "--max-bytes")
    assert list(cell.out.iterdir()) == []


# ---- ir2tbe -------------------------------------------------------------------------
ACL_CASES = {
    "fifo": None,
    "directory": None,
    "deeply_nested": "[" * 100_000 + "]" * 100_000,
    "binary": b"\x00\xff\xfe\x80garbage",
    "not_an_object": "[1, 2, 3]",
    "dump_not_object": '{"dump": 5}',
    "bad_mode": '{"dump": {"dump_mode": "sometimes", "dump_op_switch": "on"}}',
    "bad_path": '{"dump": {"dump_path": 5, "dump_op_switch": "on"}}',
    "bad_list": '{"dump": {"dump_list": [5], "dump_op_switch": "on"}}',
    "bad_layer": '{"dump": {"dump_list": [{"layer": "x"}], "dump_op_switch": "on"}}',
    "huge": " " * (2 << 20),
    "not_json": "{dump: on",
}


@pytest.mark.parametrize("case", sorted(ACL_CASES))
def test_ir2tbe_malformed_acl_json_one_line(cell, dumps, case):
    golden, _, _ = dumps
    acl = cell.tmp / "acl.json"
    if case == "fifo":
        os.mkfifo(acl)
    elif case == "directory":
        acl.mkdir()
    else:
        data = ACL_CASES[case]
        acl.write_bytes(data if isinstance(data, bytes) else data.encode())
    cell.freeze()
    r = run("ir2tbe", "run", golden, "--acl-config", acl, "--dump-path", cell.out, cwd=cell.tmp)
    cell.check(r, 2, str(acl))


@pytest.mark.parametrize("case", ["fifo", "not_hdf5", "missing"])
def test_ir2tbe_malformed_dump_one_line(cell, case):
    dump = cell.tmp / "in.h5"
    if case == "fifo":
        os.mkfifo(dump)
    elif case == "not_hdf5":
        dump.write_bytes(MARKER)
    acl = cell.tmp / "acl.json"
    acl.write_text('{"dump": {"dump_path": "out", "dump_mode": "all", "dump_op_switch": "on"}}')
    cell.freeze()
    r = run("ir2tbe", "run", dump, "--acl-config", acl, cwd=cell.tmp)
    cell.check(r, 2, str(dump))


# ---- the module itself -----------------------------------------------------------------
def test_output_path_rules(tmp_path):
    target = tmp_path / "t.txt"
    target.write_text("keep")
    dangling = tmp_path / "dangling.txt"
    os.symlink(tmp_path / "nowhere", dangling)
    link = tmp_path / "link.txt"
    os.symlink(target, link)
    for p in (target, dangling, link):
        with pytest.raises(DumpWriteError, match="already exists"):
            with open_output(p, "w") as f:
                f.write("x")
    assert not (tmp_path / "nowhere").exists() and target.read_text() == "keep"
    with open_output(link, "w", force=True) as f:       # replaces the link, not the file
        f.write("new")
    assert not os.path.islink(link) and link.read_text() == "new" and target.read_text() == "keep"
    with pytest.raises(RuntimeError):                   # a failed write leaves nothing behind
        with output_path(tmp_path / "half.npy") as tmp:
            Path(tmp).write_bytes(b"partial")
            raise RuntimeError("boom")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling.txt", "link.txt", "t.txt"]


def test_new_dir_names_and_budget(tmp_path):
    os.symlink(tmp_path, tmp_path / "failed_1")
    assert new_dir(tmp_path, "failed_1") == str(tmp_path / "failed_1_1")
    names = NameSet()
    assert [names.unique("a"), names.unique("a"), names.unique("a~1")] == ["a", "a~1", "a~1~1"]
    assert parse_size("16G") == 16 << 30 and parse_size("1.5k") == 1536 and parse_size("100") == 100
    with pytest.raises(DumpWriteError, match="--max-bytes"):
        parse_size("lots")
    b = OutputBudget(max_files=2, max_bytes=10)
    b.charge("x", 5)
    with pytest.raises(DumpWriteError, match="--max-bytes"):
        b.charge("y", 6)
    b.charge("y", 5)
    with pytest.raises(DumpWriteError, match="--max-files"):
        b.charge("z", 0)


def test_acl_json_repair_of_blank_lines_is_linear():
    """60 KB of blank lines took 25 s with the old regex; 2 MB is now a fraction of a second
    (checked side by side in benchmarks/bench_acl_repair.py). Asserted: the repair itself."""
    import json

    from ir2tbe.acl_config import repair_json

    text = '{"dump": {"dump_mode": "all"' + "\n" * 200_000 + '"dump_op_switch": "on" # c\n}}'
    fixed, changed = repair_json(text)
    assert changed and json.loads(fixed) == {"dump": {"dump_mode": "all", "dump_op_switch": "on"}}


def test_convert_streams_each_tensor_by_chunks(tmp_path):
    """convert reads a tensor chunk by chunk (memory bounded by the chunk): the chunks of a
    bf16 tensor, decoded, are the whole array's values, and the .npy written from them is
    the array."""
    from accucmp.convert import convert_paths
    from ir2tbe.dump_data import read_kernel_dump

    bits = np.random.default_rng(3).integers(0, 1 << 16, size=(7, 5), dtype=np.uint16)
    src = tmp_path / KNAME
    write_kernel_dump(src, "pool1", [TensorToWrite(bits, "bfloat16")], [])
    entry = read_kernel_dump(src, with_data=False).inputs[0]
    chunks = list(entry.chunks(str(src), chunk_bytes=8))
    assert len(chunks) == 9 and all(c.size <= 4 for c in chunks)   # 35 elements, 4 per chunk
    whole = read_kernel_dump(src).inputs[0].array()
    np.testing.assert_array_equal(np.concatenate(chunks).view(np.uint32), whole.reshape(-1).view(np.uint32))
    res = convert_paths([str(src)], str(tmp_path / "o"), "both")
    assert res.ok
    np.testing.assert_array_equal(np.load(tmp_path / "o" / f"{KNAME}.input.0.npy").view(np.uint32),
                                  whole.view(np.uint32))


def test_golden_force_replaces_a_link_not_its_target(tmp_path):
    """--force: the golden lands at the name; the file a link there pointed to is untouched."""
    import torch
    from typer.testing import CliRunner

    from accucmp.cli.main import app
    from dumpfile import DumpFile

    from ._replay_helpers import record

    aten = torch.ops.aten
    record(tmp_path / "d.h5", [(aten.relu.default, (torch.randn(4, 4),), {})])
    marker = tmp_path / "secret.txt"
    marker.write_bytes(MARKER)
    link = tmp_path / "g.h5"
    os.symlink(marker, link)
    r = CliRunner().invoke(app, ["golden", "-i", str(tmp_path / "d.h5"), "-o", str(link), "--force",
                                 "--no-progress"])
    assert r.exit_code == 0, r.output
    assert str(link) in r.output and marker.read_bytes() == MARKER and not os.path.islink(link)
    with DumpFile(link) as g:
        assert len(g.ops()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.h5", "g.h5", "secret.txt"]   # no temporary left


def test_compare_p_caps_bytes_before_reading(cell, dumps):
    golden, faulty, _ = dumps
    cell.freeze()
    r = run("accucmp", "compare", "-m", faulty, "-g", golden, "-o", cell.out, "-p", "-q", "--max-bytes", "10",
            cwd=cell.tmp)
    cell.check(r, 2, "--max-bytes")
    assert not list(cell.out.rglob("*.npy"))


@pytest.mark.parametrize("command", ["compare", "convert", "golden-dir"])
def test_output_folder_that_is_a_file_is_one_line(cell, dumps, command):
    golden, faulty, _ = dumps
    cell.out.write_bytes(MARKER)
    src = cell.tmp / KNAME
    _kernel_dump(src)
    cell.freeze()
    if command == "compare":
        r = run("accucmp", "compare", "-m", faulty, "-g", golden, "-o", cell.out, "-q", cwd=cell.tmp)
        where = cell.out
    elif command == "convert":
        r = run("accucmp", "convert", "-d", src, "-out", cell.out, cwd=cell.tmp)
        where = cell.out
    else:
        where = cell.out / "g.h5"
        r = run("accucmp", "golden", "-i", golden, "-o", where, "--no-progress", cwd=cell.tmp)
    cell.check(r, 2, str(where))
    assert cell.out.read_bytes() == MARKER
