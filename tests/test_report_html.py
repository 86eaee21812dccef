"""Issue 22: the HTML report, parsed with an HTML5 parser (html5lib, strict: any parse error
fails). The verdict sentence comes first, then the worst ops (reason first), the plot with
the failing ops marked, the run as a table, and the full sortable, filterable table; one
self-contained file."""

from __future__ import annotations

import numpy as np
import pytest
from typer.testing import CliRunner

from accucmp.cli.main import app
from tests._compare_helpers import bf16, write_dump

html5lib = pytest.importorskip("html5lib")

NS = {"h": "http://www.w3.org/1999/xhtml"}
# a module name matplotlib would read as a formula ("$x^$") if it were not told otherwise
DOLLAR_MODULE = "blocks.$x^$.proj"


def _ops(fault: float = 1.0):
    rng = np.random.default_rng(5)
    a = rng.standard_normal((32, 16)).astype(np.float32)
    ops = []
    for i, mod in enumerate(["embed", DOLLAR_MODULE, "head"]):
        out = bf16(a * (i + 1) * (fault if i >= 1 else 1.0))
        ops.append(dict(op="aten.gelu.default" if i == 1 else "aten.mm.default", seqid=i + 1, module=mod,
                        phase="forward", inputs={"self": (bf16(a), "bfloat16")}, outputs={"result": (out, "bfloat16")}))
    return ops


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    d = tmp_path_factory.mktemp("html")
    write_dump(d / "g.h5", _ops())
    write_dump(d / "t.h5", _ops(fault=1.05))
    r = CliRunner(env={"NO_COLOR": "1"}).invoke(app, ["compare", "-m", str(d / "t.h5"), "-g", str(d / "g.h5"),
                                                      "-o", str(d / "out"), "-f", "html"])
    assert r.exit_code == 1, r.output
    text = next((d / "out").glob("result_*.html")).read_text(encoding="utf-8")
    return text, r.output.splitlines()[0], d


def _text(el) -> str:
    return "".join(el.itertext()).strip()


def test_html_parses_and_reads_top_down(page):
    text, sentence, d = page
    doc = html5lib.HTMLParser(strict=True, namespaceHTMLElements=True).parse(text)   # raises on a parse error
    body = doc.find("h:body", NS)
    # 1. the verdict sentence, as the terminal's first line
    h1 = body.find(".//h:header/h:h1", NS)
    assert _text(h1) == sentence
    assert sentence.startswith(f"FAIL: first op caused here is aten.gelu.default #2 in {DOLLAR_MODULE}: RelErr ")
    # 2. the worst ops, reason first, the deciding threshold named
    worst = body.find(".//h:table[@class='worst']", NS)
    heads = [_text(th) for th in worst.findall(".//h:thead//h:th", NS)]
    assert heads[0].startswith("Why it fails") and heads[1] == "Op"
    first_row = [_text(td) for td in worst.find(".//h:tbody/h:tr", NS).findall("h:td", NS)]
    assert first_row[0].startswith("RelErr") and "allowed for bfloat16" in first_row[0]
    assert "RelativeEuclideanDistanceUlps" in first_row[0]
    assert DOLLAR_MODULE in [_text(tr.findall("h:td", NS)[4]) for tr in worst.findall(".//h:tbody/h:tr", NS)]
    # 3. the plot: inline SVG with the failing ops marked (legend "fail") and the module title intact
    svg = body.find(".//h:div[@class='plot']/{http://www.w3.org/2000/svg}svg", NS)
    assert svg is not None
    svg_text = "".join(svg.itertext())
    assert "fail" in svg_text and "first failure" in svg_text
    # 4. the run as a table, a column per dump (these hand-written dumps record no device or torch)
    metas = body.findall(".//h:table[@class='meta']", NS)
    run = metas[0]
    assert [_text(th) for th in run.findall(".//h:thead//h:th", NS)] == ["", "target", "golden"]
    rows = {_text(tr.find("h:th", NS)): [_text(td) for td in tr.findall("h:td", NS)]
            for tr in run.findall(".//h:tbody/h:tr", NS)}
    assert rows["file"] == [str(d / "t.h5"), str(d / "g.h5")] and rows["mode"] == ["dump", "dump"]
    assert rows["tensor dtypes"] == ["bfloat16 (6)", "bfloat16 (6)"]
    # 5. the full table: every row, sortable and filterable, with its controls
    full = body.find(".//h:table[@id='all']", NS)
    assert len(full.findall(".//h:tbody/h:tr", NS)) == 6
    assert [_text(th) for th in full.findall(".//h:thead//h:th", NS)][:3] == ["Index", "Result", "FailReason"]
    assert body.find(".//h:input[@id='filter']", NS) is not None
    assert body.find(".//h:input[@id='hidepass']", NS) is not None
    # order on the page: verdict, worst ops, plot, run, all tensors
    order = [text.find(m) for m in ("<header class='verdict", "<table class='worst'", "<div class='plot'>",
                                    "<h2>Run</h2>", "<table id='all'>")]
    assert order == sorted(order) and -1 not in order


def test_html_is_one_self_contained_file(page):
    text, _, _ = page
    doc = html5lib.parse(text, namespaceHTMLElements=False)
    for el in doc.iter():
        for attr in ("src", "href"):
            v = el.get(attr)
            assert v is None or v.startswith(("#", "data:")), (el.tag, attr, v)
    scripts = [el for el in doc.iter("script")]
    assert scripts and all(el.get("src") is None for el in scripts)
    assert "http://" not in "".join(s.text or "" for s in scripts)


def test_underflow_and_inherited_are_explained():
    import pandas as pd

    from accucmp.report.html import render_html

    t = pd.DataFrame({
        "Index": [0, 1, 2], "NPUDump": ["aten.mm.default"] * 3, "SeqId": [1, 2, 3],
        "NPUDumpPath": [f"/aten.mm.default/{i}/output/result" for i in (1, 2, 3)],
        "GroundTruthPath": [f"/aten.mm.default/{i}/output/result" for i in (1, 2, 3)],
        "Phase": ["backward"] * 3, "Module": ["a", "b", "c"], "Result": ["fail", "fail", "pass"],
        "FailReason": ["RelativeEuclideanDistance 0.01 > 0.003 [golden max|x| 3e-05 is near or below float16's "
                       "smallest normal 6.1e-05: underflow in float16 (what loss scaling is for), not necessarily "
                       "a kernel bug]", "RelativeEuclideanDistance 0.01 > 0.003", ""],
        "Severity": [3.0, 3.0, 0.1], "PrecisionDtype": ["float16"] * 3,
    })
    doc = html5lib.parse(render_html(t), namespaceHTMLElements=False)
    box = doc.find(".//section[@class='explain']")
    text = "".join(box.itertext())
    assert "Underflow" in text and "loss scaling" in text
    assert "Inherited" in text and "1 op(s) after the first failing one" in text
