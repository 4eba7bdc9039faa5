"""`hf-unlearn eval ...` end to end on a tiny saved Llama (in-process CLI)."""

import json

import pytest

from hf_unlearn.cli import main

from .conftest import MUSE_DIR, TOFU_DIR

TOFU = ["--tofu", str(TOFU_DIR), "--max-items", "2", "--max-new-tokens", "2", "--quiet"]


@pytest.mark.slow  # three TOFU evaluations and a plot through the CLI (~20 s)
def test_tofu_reference_then_tofu_with_reference_then_tradeoff(tiny_llama_dir, tmp_path, capsys):
    ref = tmp_path / "ref"
    assert main(["eval", "tofu-reference", str(tiny_llama_dir), "--out", str(ref), "--max-train-rows", "4", "--epochs", "1",
                 "--train-batch-size", "2", "--grad-accum", "1", *TOFU]) == 0
    assert (ref / "model" / "config.json").is_file() and (ref / "tofu_summary.md").is_file()
    ref_json = json.loads((ref / "tofu_results.json").read_text())
    assert ref_json["meta"]["reference_recipe"]["max_train_rows"] == 4

    out = tmp_path / "model"
    assert main(["eval", "tofu", str(tiny_llama_dir), "--out", str(out), "--reference", str(ref / "tofu_results.json"),
                 *TOFU]) == 0
    result = json.loads((out / "tofu_results.json").read_text())
    assert 0 <= result["summary"]["forget_quality"] <= 1 and result["summary"]["privleak"] is not None
    assert (out / "truth_ratio.png").read_bytes()[:4] == b"\x89PNG"
    assert "forget_quality" in capsys.readouterr().out

    png = tmp_path / "trade.png"
    assert main(["eval", "plot-tradeoff", f"reference={ref / 'tofu_results.json'}", str(out / "tofu_results.json"),
                 "--out", str(png)]) == 0
    assert png.stat().st_size > 1000


@pytest.mark.slow  # the default suite's time budget (`make test-slow` runs it)
def test_tofu_with_forget_ids(tiny_llama_dir, tmp_path):
    out = tmp_path / "ids"
    assert main(["eval", "tofu", str(tiny_llama_dir), "--out", str(out), "--forget-ids", "3610-3611", *TOFU]) == 0
    assert json.loads((out / "tofu_results.json").read_text())["meta"]["forget_ids"] == [3610, 3611]


def test_reference_may_not_train_on_forget_ids(tiny_llama_dir, tmp_path, capsys):
    assert main(["eval", "tofu-reference", str(tiny_llama_dir), "--out", str(tmp_path), "--train-ids", "0-41",
                 "--forget-ids", "0-39", *TOFU]) == 1
    assert "must never see them" in capsys.readouterr().err
    assert main(["eval", "tofu-reference", str(tiny_llama_dir), "--out", str(tmp_path), "--forget-ids", "0-39", *TOFU]) == 1
    assert "overlap retain90" in capsys.readouterr().err


def test_bad_input_gives_one_line_errors(tiny_llama_dir, tmp_path, capsys):
    assert main(["eval", "tofu", str(tiny_llama_dir), "--out", str(tmp_path), "--chat-template", "yes", *TOFU]) == 1
    assert "has none" in capsys.readouterr().err
    assert main(["eval", "tofu", str(tiny_llama_dir), "--out", str(tmp_path), "--forget-ids", "36x0", *TOFU]) == 1
    assert "cannot read ids" in capsys.readouterr().err
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"kind": "tofu", "summary": {}, "meta": {"forget_split": "forget01"}}))
    assert main(["eval", "tofu", str(tiny_llama_dir), "--out", str(tmp_path), "--reference", str(other), *TOFU]) == 1
    assert "forget01" in capsys.readouterr().err


@pytest.mark.slow  # a quantized evaluation and MUSE through the CLI (~11 s)
def test_quantized_and_muse_news(tiny_llama_dir, tmp_path):
    pytest.importorskip("bitsandbytes")
    out = tmp_path / "q"
    assert main(["eval", "quantized", str(tiny_llama_dir), "--bits", "4", "--out", str(out), *TOFU]) == 0
    q = json.loads((out / "quantized_results.json").read_text())
    assert q["summary"]["forget_truth_ratio"]["after"] != q["summary"]["forget_truth_ratio"]["before"]

    out = tmp_path / "muse"
    assert main(["eval", "muse-news", str(tiny_llama_dir), "--out", str(out), "--muse", str(MUSE_DIR), "--max-items", "2",
                 "--max-length", "32", "--max-prompt-tokens", "32", "--verbmem-max-new-tokens", "3", "--knowmem-max-new-tokens", "3",
                 "--quiet"]) == 0
    assert json.loads((out / "muse_results.json").read_text())["kind"] == "muse_news"
