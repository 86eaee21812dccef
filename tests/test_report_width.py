"""The terminal summary and `ls --stats` of a run with long module paths and long op names,
at 80 columns (issue 35 item 2): op names shortened where they say least (`aten.` and
`.default` go before the middle), module paths keep their end, a number never split from
its unit, continuation lines indented; `ls --stats` never breaks a name mid-word."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from accucmp.report.fit import short_module, short_op, wrap_dotted, wrap_prose

from ._cli_helpers import model_ops, perturbed, write_dump

WIDTH = 80
PREFIX = "model.transformer.encoder.layers.11.self_attention.output_projection"
LONG_OPS = {"aten.mm.default": "aten.convolution_backward.default",
            "aten.threshold_backward.default": "aten.native_layer_norm_backward.default"}


def _long_names(ops):
    for o in ops:
        o.op = LONG_OPS.get(o.op, o.op)
        o.module = f"{PREFIX}.{o.module}"
    return ops


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    d = tmp_path_factory.mktemp("wide")
    golden = _long_names(model_ops())
    target = perturbed(perturbed(perturbed(golden, 2, 0.05), 10, 0.2), 12, 0.3)
    for o in target:
        o.dtype = "bfloat16"
    return write_dump(d / "t.h5", target), write_dump(d / "g.h5", golden)


def _terminal() -> Console:
    return Console(file=io.StringIO(), width=WIDTH, force_terminal=True, color_system=None)


def test_fitting_rules():
    assert short_op("aten.convolution_backward.default", 30) == "convolution_backward.default"
    assert short_op("aten.convolution_backward.default", 25) == "convolution_backward"
    assert short_op("aten.add.Tensor", 12) == "add.Tensor"               # a distinguishing overload stays
    assert short_op("aten.native_layer_norm_backward.default", 20) == "native_lay…_backward"
    assert short_module(f"{PREFIX}.layers.0", 20) == "…projection.layers.0"
    assert wrap_dotted("model.encoder.layers.11.mlp", 15) == ["model.encoder.", "layers.11.mlp"]
    lines = wrap_prose("FAIL: first op is x in y: RelErr 41 u > 6 u allowed for bfloat16", 40)
    assert lines == ["FAIL: first op is x in y: RelErr 41 u", "  > 6 u allowed for bfloat16"]


def test_summary_at_80_columns_with_long_module_paths(dumps):
    from accucmp.compare.pipeline import compare_dumps
    from accucmp.compare.verdict import apply_verdict
    from accucmp.report.summary import print_summary

    target, golden = dumps
    table = apply_verdict(compare_dumps(target, golden).table)
    console = _terminal()
    print_summary(table, console=console, top=5)
    text = console.file.getvalue()
    lines = text.splitlines()
    assert max(map(len, lines)) <= WIDTH, text
    # the headline: the module path keeps its end, the bound whole, the rest indented
    assert lines[0].startswith("FAIL: first op caused here is aten.add.Tensor #2 in …"), text
    assert lines[0].rstrip(":").endswith("layers.0"), text
    assert lines[1] == "  RelErr 12.9 u > 6 u allowed for bfloat16", text
    # a continuation line is indented under the line it continues
    i = next(i for i, ln in enumerate(lines) if ln.startswith("first failure"))
    assert lines[i + 1].startswith("  model.transformer."), text
    # worst ops: the op names lose aten./.default before their middle, never the reverse
    worst = text[text.index("worst failing ops"):]
    assert "native_la" in worst and "_backward" in worst, worst
    assert not re.search(r"aten\.\S*…|…\S*\.default", text), text
    assert "…layers.1" in worst and "…layers.2" in worst, worst
    # a number stays with its unit and comparison
    for why in re.findall(r"RelErr .*", text):
        assert re.fullmatch(r"RelErr [\d.]+ u > 6 u allowed for bfloat16", why), why


def test_ls_stats_at_80_columns_breaks_no_name_mid_word(dumps):
    from accucmp.listing import list_ops, render

    target, _ = dumps
    lines, info = list_ops(target, stats=True)
    console = _terminal()
    render(lines, info, console=console, plain=False, stats=True)
    text = console.file.getvalue()
    rows = text.splitlines()
    assert max(map(len, rows)) <= WIDTH, text
    # the first column of each op: "seqid op", then its module path over lines broken
    # after dots, then the phase; put back together it is the whole path
    firsts = [re.split(r"\s{2,}", r.strip(), maxsplit=1)[0] if r.startswith(" ") and not r.startswith("  ") else ""
              for r in rows]
    blocks, cur = [], []
    for cell in firsts[3:]:
        if re.match(r"\d+ ", cell):
            cur = [cell]
            blocks.append(cur)
        elif cell and cur:
            cur.append(cell)
    assert len(blocks) == len(lines), text
    for ln, block in zip(lines, blocks):
        op = block[0].split(" ", 1)[1]
        core = ln.op.removeprefix("aten.").removesuffix(".default")
        if "…" in op:         # too long for its column even without aten./.default: both ends kept
            head, tail = op.split("…")
            assert core.startswith(head) and core.endswith(tail) and len(head) >= 8 and len(tail) >= 8, block
        else:
            assert op in (ln.op, ln.op.removeprefix("aten."), core), block
        assert "".join(block[1:]) == f"{ln.module}{ln.phase}" or " ".join(["".join(block[1:-1]), block[-1]]) \
            == f"{ln.module} {ln.phase}" or "".join(block[1:]).replace(" ", "") == f"{ln.module}{ln.phase}", block
    assert sum("…" in b[0] for b in blocks) >= 3, text    # native_layer_norm_backward at least


def test_ls_table_at_80_columns_breaks_names_only_after_dots_and_underscores(dumps):
    from accucmp.listing import list_ops, render

    target, _ = dumps
    lines, info = list_ops(target)
    console = _terminal()
    render(lines, info, console=console, plain=False, stats=False)
    text = console.file.getvalue()
    assert max(map(len, text.splitlines())) <= WIDTH, text
    ops, modules, pieces = [], [], []
    for row in text.splitlines():
        cells = row.split("│")
        if len(cells) != 8:
            continue
        seqid, op, module = cells[1].strip(), cells[2].strip(), cells[4].strip()
        if seqid:
            ops.append(op)
            modules.append(module)
            pieces.append(([op], [module]))
        else:
            ops[-1] += op
            modules[-1] += module
            pieces[-1][0].append(op)
            pieces[-1][1].append(module)
    # every line of a name but its last ends after a dot or an underscore
    for op_lines, module_lines in pieces:
        for part in [p for p in op_lines if p][:-1] + [p for p in module_lines if p][:-1]:
            assert part.endswith((".", "_")), (part, text)
    # put back together, each cell is the whole name: no piece was cut or shortened
    assert ops == [ln.op for ln in lines], text
    assert modules == [ln.module for ln in lines], text
    assert "…" not in text
