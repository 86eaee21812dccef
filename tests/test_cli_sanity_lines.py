"""Sanity lines of `accucmp compare` (issue 31): one stderr note for a comparison that is
probably not the one meant; verdict and exit status unchanged."""

from __future__ import annotations

from pathlib import Path

from accucmp.cli.compare import sanity_lines


def test_same_file(tmp_path):
    p = tmp_path / "a.h5"
    p.write_bytes(b"x")
    (line,) = sanity_lines({}, p, Path(str(p)))
    assert "same file" in line and "passes by construction" in line


def test_swapped_roles(tmp_path):
    (line,) = sanity_lines({"target_mode": "dump", "golden_mode": "load", "paired_ops": 40, "target_ops": 40,
                            "golden_ops": 40}, tmp_path / "gold.h5", tmp_path / "npu.h5")
    assert "look swapped" in line and "npu.h5" in line


def test_a_replay_that_matched_less_than_half(tmp_path):
    (line,) = sanity_lines({"target_mode": "load", "golden_mode": "dump", "paired_ops": 10, "target_ops": 10,
                            "golden_ops": 50}, tmp_path / "npu.h5", tmp_path / "gold.h5")
    assert "matched 10 of the 50 recorded ops" in line


def test_two_different_models(tmp_path):
    (line,) = sanity_lines({"target_mode": "dump", "golden_mode": "dump", "paired_ops": 3, "target_ops": 40,
                            "golden_ops": 60}, tmp_path / "a.h5", tmp_path / "b.h5")
    assert "same model" in line


def test_a_normal_comparison_says_nothing(tmp_path):
    assert sanity_lines({"target_mode": "load", "golden_mode": "dump", "paired_ops": 49, "target_ops": 49,
                         "golden_ops": 50}, tmp_path / "npu.h5", tmp_path / "gold.h5") == []
    assert sanity_lines({"target_mode": "dump", "golden_mode": "dump", "paired_ops": 40, "target_ops": 45,
                         "golden_ops": 41}, tmp_path / "a.h5", tmp_path / "b.h5") == []
