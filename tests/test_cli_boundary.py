"""The one CLI boundary (dumpfile/cli_boundary.py): every Status reached through a real
command of accucmp and of ir2tbe; a bug of ours is exit 3 with a "please report" line and
its traceback in a log file that is created new and never through a link."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import tempfile

import pytest
from typer.testing import CliRunner

from accucmp.cli.main import app
from dumpfile import cli_boundary
from dumpfile import schema as S
from dumpfile.cli_boundary import Status

from ._cli_helpers import model_ops, perturbed, write_dump

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _runner() -> CliRunner:
    return CliRunner(env={"COLUMNS": "120", "NO_COLOR": "1", "ACCUCMP_DEBUG": None, "IR2TBE_DEBUG": None})


@pytest.fixture
def state(tmp_path, monkeypatch):
    """Logs go to a folder of this test (XDG_STATE_HOME), the fallback to another."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.delenv("ACCUCMP_DEBUG", raising=False)
    monkeypatch.delenv("IR2TBE_DEBUG", raising=False)
    fallback = tmp_path / "tmp"
    fallback.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(fallback))
    return tmp_path / "state" / "accucmp", fallback


def _one_error_line(r) -> str:
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.output, r.output
    return lines[0]


def _logged_path(line: str) -> str:
    assert "with the log file " in line, line
    return line.rsplit("with the log file ", 1)[1].strip()


# ---- each Status through a real command --------------------------------------------------
def test_findings_exit_1_and_ok_exit_0(tmp_path):
    ops = model_ops(seed=0)
    golden = write_dump(tmp_path / "golden.h5", ops)
    faulty = write_dump(tmp_path / "faulty.h5", perturbed(ops, 5, 0.05, noise=2 ** -24), mode=S.MODE_LOAD)
    r = _runner().invoke(app, ["compare", "-m", faulty, "-g", golden, "-out", str(tmp_path / "o"), "-q"])
    assert r.exit_code == Status.FINDINGS == 1, r.output
    r = _runner().invoke(app, ["compare", "-m", golden, "-g", golden, "-out", str(tmp_path / "o2"), "-q"])
    assert r.exit_code == Status.OK == 0, r.output


@pytest.mark.parametrize("content", [None, b"not an HDF5 file\n"])
def test_bad_input_file_exit_2_one_line_naming_it(tmp_path, state, content):
    path = tmp_path / "npu.h5"
    if content is not None:
        path.write_bytes(content)
    r = _runner().invoke(app, ["ls", str(path)])
    assert r.exit_code == Status.BAD_INPUT == 2, r.output
    line = _one_error_line(r)
    assert line.startswith("accucmp: error: ") and str(path) in line, line
    assert not state[0].exists(), "bad input is not a bug: no log"


def test_bad_option_value_exit_2(tmp_path):
    ops = model_ops(seed=0)
    golden = write_dump(tmp_path / "golden.h5", ops)
    r = _runner().invoke(app, ["compare", "-m", golden, "-g", golden, "--alg", "NoSuchMetric"])
    assert r.exit_code == 2, r.output
    assert "NoSuchMetric" in _one_error_line(r)


def test_internal_error_exit_3_please_report_and_traceback_in_a_log(tmp_path, state, monkeypatch):
    import accucmp.listing

    def broken(*a, **k):
        raise ZeroDivisionError("a bug of ours")

    monkeypatch.setattr(accucmp.listing, "list_ops", broken)
    dump = write_dump(tmp_path / "d.h5", model_ops(seed=0))
    r = _runner().invoke(app, ["ls", dump])
    assert r.exit_code == Status.INTERNAL == 3, r.output
    line = _one_error_line(r)
    assert line.startswith("accucmp: internal error") and "please report it" in line, line
    assert "ZeroDivisionError: a bug of ours" in line
    log = _logged_path(line)
    assert os.path.dirname(log) == str(state[0])
    text = open(log).read()
    assert "Traceback (most recent call last)" in text and "in broken" in text and "a bug of ours" in text
    assert os.stat(log).st_mode & 0o077 == 0, "the log is the user's own"


def test_debug_switch_reraises(tmp_path, monkeypatch):
    import accucmp.listing

    monkeypatch.setattr(accucmp.listing, "list_ops", lambda *a, **k: 1 / 0)
    dump = write_dump(tmp_path / "d.h5", model_ops(seed=0))
    r = CliRunner(env={"ACCUCMP_DEBUG": "1"}).invoke(app, ["ls", dump])
    assert isinstance(r.exception, ZeroDivisionError)


def test_interrupt_exit_130(tmp_path, monkeypatch):
    import accucmp.listing

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(accucmp.listing, "list_ops", interrupted)
    r = _runner().invoke(app, ["ls", write_dump(tmp_path / "d.h5", model_ops(seed=0))])
    assert r.exit_code == Status.INTERRUPTED == 130
    assert _one_error_line(r) == "accucmp: interrupted"


# ---- the log file: never through a link, and a log that cannot be written is said --------
def test_log_never_written_through_a_link(tmp_path, state):
    state_dir, fallback = state
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    state_dir.parent.mkdir(parents=True)
    os.symlink(elsewhere, state_dir)            # the log folder is a link: not ours to write in
    path, why = cli_boundary.write_log("accucmp", ZeroDivisionError("x"))
    assert why is None and os.listdir(elsewhere) == []
    assert os.path.dirname(path) == str(fallback)
    assert "ZeroDivisionError: x" in open(path).read()


def test_log_that_cannot_be_written_is_said_in_the_same_line(tmp_path, state, monkeypatch):
    state_dir, _ = state
    state_dir.parent.mkdir(parents=True)
    state_dir.write_text("a file where the folder should be")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no" / "such" / "dir"))
    line = cli_boundary.internal_error_line("accucmp", ValueError("x"))
    assert "\n" not in line and "please report it" in line
    assert "its traceback could not be saved" in line and str(state_dir) in line


# ---- ir2tbe goes through the same boundary -----------------------------------------------
def test_ir2tbe_bad_input_2_and_internal_error_3(tmp_path, state, monkeypatch):
    from ir2tbe import acl_config
    from ir2tbe.cli import app as ir2tbe_app

    missing = tmp_path / "missing.h5"
    r = _runner().invoke(ir2tbe_app, ["run", str(missing)])
    assert r.exit_code == 2, r.output
    line = _one_error_line(r)
    assert line.startswith("ir2tbe: error: ") and str(missing) in line

    def broken():
        raise ZeroDivisionError("a bug in ir2tbe")

    monkeypatch.setattr(acl_config, "check_acl_dump_env", broken)
    dump = write_dump(tmp_path / "d.h5", model_ops(seed=0))
    r = _runner().invoke(ir2tbe_app, ["run", dump])
    assert r.exit_code == 3, r.output
    line = _one_error_line(r)
    assert line.startswith("ir2tbe: internal error") and "please report it" in line
    assert "a bug in ir2tbe" in open(_logged_path(line)).read()


# ---- every command, and the entry point around them ----------------------------------------
def test_every_command_runs_inside_the_boundary():
    from ir2tbe.cli import app as ir2tbe_app

    for a in (app, ir2tbe_app):
        for cmd in a.registered_commands:
            assert "with boundary(" in inspect.getsource(cmd.callback), cmd.callback.__qualname__


def test_entry_point_exits_3_as_a_process(tmp_path):
    """main() (the `accucmp` script): the status reaches the shell, the traceback only the log."""
    dump = write_dump(tmp_path / "d.h5", model_ops(seed=0))
    code = ("import sys, accucmp.listing as L\n"
            "def broken(*a, **k): raise ZeroDivisionError('a bug of ours')\n"
            "L.list_ops = broken\n"
            "from accucmp.cli.main import main\nmain(['ls', sys.argv[1]])\n")
    env = {k: v for k, v in os.environ.items() if k not in ("ACCUCMP_DEBUG", "IR2TBE_DEBUG")}
    env.update(PYTHONPATH=ROOT, XDG_STATE_HOME=str(tmp_path / "state"))
    p = subprocess.run([sys.executable, "-c", code, dump], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 3, p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "accucmp ls " + dump in open(_logged_path(p.stderr)).read()


def test_cli_modules_stay_small():
    """One concern per CLI module (issue 19): none over 400 lines."""
    import glob

    paths = glob.glob(os.path.join(ROOT, "accucmp", "cli", "*.py")) + [
        os.path.join(ROOT, "ir2tbe", "cli.py"), os.path.join(ROOT, "dumpfile", "cli_boundary.py")]
    sizes = {os.path.relpath(p, ROOT): sum(1 for _ in open(p)) for p in paths}
    assert len(sizes) >= 10 and not {p: n for p, n in sizes.items() if n > 400}, sizes
