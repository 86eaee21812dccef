"""Load-replay keeps a backend's opaque buffers live (npu_dumper/replay/load_replay.py,
`_substitute`): the LSTM workspace `mkldnn_rnn_layer` hands its backward is laid out for the
dtype that wrote it. Handing the fp32 recording's workspace to the bf16 replay's backward
made every LSTM gradient NaN, and a clean replay failed 14 rows at
`mkldnn_rnn_layer_backward` ("NaN/Inf on one side only"); a plain bf16 dump of the same
step passes."""

from __future__ import annotations

import contextlib
import io

import torch

import npu_dumper  # noqa: F401  (installs torch.utils.dumper)
import sample_models
from accucmp.compare.pipeline import compare_dumps
from accucmp.compare.verdict import apply_verdict


def _step(spec, model, batch):
    torch.manual_seed(1)
    spec.train_step(model, batch)


def test_a_bf16_replay_of_an_fp32_lstm_recording_passes(tmp_path):
    spec = sample_models.get("lstm_lm")
    model, batch = spec.build(seed=0, size="tiny"), spec.make_inputs(seed=0, size="tiny")
    golden, replay = tmp_path / "gold.h5", tmp_path / "replay.h5"
    with torch.utils.dumper(use_dump=True, dump_path=str(golden)):
        _step(spec, model, batch)
    model, batch = spec.build(seed=0, size="tiny"), spec.make_inputs(seed=0, size="tiny")
    with contextlib.redirect_stdout(io.StringIO()), torch.autocast("cpu", dtype=torch.bfloat16), \
            torch.utils.dumper(use_load=True, load_file_path=str(golden), dump_path=str(replay)):
        _step(spec, model, batch)
    table = apply_verdict(compare_dumps(str(replay), str(golden)).table)
    backward = table[table.NPUDump == "aten.mkldnn_rnn_layer_backward.default"]
    assert len(backward) > 0 and (backward.CompareStatus == "compared").any()   # the op is judged
    assert int((table.Result == "fail").sum()) == 0, table[table.Result == "fail"][["NPUDump", "TensorName"]]


class _BiLSTM(torch.nn.Module):
    """A bidirectional LSTM whose bf16 workspace is smaller than its fp32 one (36,864 against
    45,056 bytes): the recorded call did not fit the live one, and every LSTM backward ran
    live, an inserted op the recording lacks, beside a missing one (timm's Sequencer2d)."""

    def __init__(self):
        super().__init__()
        self.lstm = torch.nn.LSTM(24, 16, batch_first=True, bidirectional=True)
        self.fc = torch.nn.Linear(32, 5)

    def forward(self, x):
        return self.fc(self.lstm(x)[0][:, -1])


def test_an_lstm_whose_workspace_size_depends_on_the_dtype_is_matched_and_passes(tmp_path):
    def step(path, **kw):
        torch.manual_seed(0)
        model = _BiLSTM()
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(3, 7, 24, generator=g), torch.randint(0, 5, (3,), generator=g)
        amp = torch.autocast("cpu", dtype=torch.bfloat16) if kw.get("use_load") else contextlib.nullcontext()
        with contextlib.redirect_stdout(io.StringIO()), amp, torch.utils.dumper(dump_path=str(path), **kw) as d:
            torch.nn.functional.cross_entropy(model(x).float(), y).backward()
        return d

    golden, replay = tmp_path / "gold.h5", tmp_path / "replay.h5"
    step(golden, use_dump=True)
    d = step(replay, use_load=True, load_file_path=str(golden))
    summary = d.summary["replay"]
    assert "aten.mkldnn_rnn_layer_backward.default" not in summary.unmatched
    assert not any(summary.departures.values())
    table = apply_verdict(compare_dumps(str(replay), str(golden)).table)
    assert (table.NPUDump == "aten.mkldnn_rnn_layer_backward.default").any()
    assert int((table.Result == "fail").sum()) == 0
