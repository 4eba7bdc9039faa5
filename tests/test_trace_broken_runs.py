"""A broken run is named, file by file (issue #31): ``trace inspect`` said ``KeyError: 'run'`` on a run missing
``wal.bin`` or with a damaged ``provenance.bin``, and ``forget`` on a run missing ``wal.bin`` said the folder "holds
no model". Each damage below gets one line naming the file, from inspect and from forget, before any compute."""

from __future__ import annotations

import shutil
import warnings

import pytest

from .test_trace_common import copy_run, get_recorded, ids_at_step


def _truncate(f, n=100):
    f.write_bytes(f.read_bytes()[:n])


def _flip(f, at=40):
    data = bytearray(f.read_bytes())
    data[at] ^= 0xFF
    f.write_bytes(bytes(data))


DAMAGE = {  # name: (compacted first?, what is done, the file the messages must name)
    "wal.bin missing": (False, lambda r: (r / "wal.bin").unlink(), "wal.bin"),
    "plan.bin missing": (False, lambda r: (r / "plan.bin").unlink(), "plan.bin"),
    "manifest.bin missing": (False, lambda r: (r / "manifest.bin").unlink(), "manifest.bin"),
    "header.json truncated": (False, lambda r: _truncate(r / "header.json"), "header.json"),
    "header.json not an object": (False, lambda r: (r / "header.json").write_text("[1]"), "header.json"),
    "provenance.bin damaged": (True, lambda r: _flip(r / "provenance.bin"), "provenance.bin"),
    "provenance.bin missing": (True, lambda r: (r / "provenance.bin").unlink(), "provenance.bin"),
    "checkpoint index missing": (False, lambda r: (r / "checkpoints" / "index.json").unlink(), "index.json"),
    "model config missing": (False, lambda r: (r / "model" / "config.json").unlink(), "model/config.json"),
    "model config damaged": (False, lambda r: _truncate(r / "model" / "config.json", 10), "model/config.json"),
    "buffers missing": (False, lambda r: (r / "model" / "buffers.safetensors").unlink(), "buffers.safetensors"),
    # valid JSON, one number changed (a replay would rebuild another model; the environment probe was blamed)
    "model config edited": (False, lambda r: _edit_json(r / "model" / "config.json", rms_norm_eps=3.3e-6),
                            "model/config.json does not match the digest in header.json"),
}


def _edit_json(f, **changes):
    import json

    f.write_text(json.dumps({**json.loads(f.read_text()), **changes}, indent=2))


@pytest.mark.parametrize("case", list(DAMAGE))
def test_inspect_and_forget_name_the_broken_file(tmp_path, case, capsys):
    from hf_unlearn.cli import main
    from hf_unlearn.data.ids import write_ids

    compacted, damage, name = DAMAGE[case]
    run = copy_run(get_recorded(), tmp_path / "run")
    write_ids(tmp_path / "ids.jsonl", ids_at_step(run, 5)[:1])
    if compacted:
        from hf_unlearn.trace.compact import compact_run

        compact_run(run)
    damage(run)
    capsys.readouterr()  # the shared run's recording output, if this test recorded it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = main(["trace", "inspect", str(run)])
        out, err = capsys.readouterr()
        assert code == 1
        text = out + err
        assert name in text and "KeyError" not in text and "HF_UNLEARN_DEBUG" not in text, text[-1500:]
        assert all(line.startswith(("ERROR", "integrity", "hf-unlearn: error", "WARNING", "run ", "checkpoints",
                                    "trainer", "model", "fidelity", "numeric stack", "note", "controls", "HAZARD",
                                    "packing", "lineage", "DPO reference", "proof"))
                   for line in text.splitlines() if line.strip()), text[-1500:]
        code = main(["forget", str(run), "--ids", str(tmp_path / "ids.jsonl"), "--out", str(tmp_path / "out"),
                     "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1 and name in err, err[-1500:]
    assert "holds no model" not in err and "HF_UNLEARN_DEBUG" not in err and not (tmp_path / "out").exists()


def test_forget_on_a_run_without_its_store_says_the_store_is_missing(tmp_path, capsys):
    from hf_unlearn.cli import main
    from hf_unlearn.data.ids import write_ids

    run = copy_run(get_recorded(), tmp_path / "run")
    write_ids(tmp_path / "ids.jsonl", ids_at_step(run, 5)[:1])
    shutil.rmtree(run / "private" / "store")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["trace", "inspect", str(run)]) == 0  # a warning: a moved store is a supported layout
        assert "private/store is absent" in capsys.readouterr().out
        code = main(["forget", str(run), "--ids", str(tmp_path / "ids.jsonl"), "--out", str(tmp_path / "out"),
                     "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1 and "store" in err and "is missing" in err, err[-1500:]
