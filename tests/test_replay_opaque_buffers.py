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
