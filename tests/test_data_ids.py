"""Deletion-request id files: typed forms keep "3600" and 3600 apart; bad files are one-line errors."""

from __future__ import annotations

import pytest

from hf_unlearn.data.ids import check_id_types, read_ids, write_ids
from hf_unlearn.errors import UnlearnError


def test_jsonl_keeps_digit_only_strings_as_strings(tmp_path):
    f = tmp_path / "req.jsonl"
    f.write_text('3600\n"3601"\n{"id": "abc-1"}\n\n3600\n')
    assert read_ids(f) == [3600, "3601", "abc-1"]


def test_json_list_and_legacy_text(tmp_path):
    (tmp_path / "a.json").write_text('[1, "1", {"id": 2}]')
    assert read_ids(tmp_path / "a.json") == [1, "1", 2]
    (tmp_path / "b.txt").write_text("# header\n12\n  7 # inline\nabc-1\n")
    assert read_ids(tmp_path / "b.txt") == [12, 7, "abc-1"]


def test_write_then_read_round_trips_types(tmp_path):
    ids = [0, "0", "007", 42, "x y"]
    assert read_ids(write_ids(tmp_path / "ids.jsonl", ids)) == ids


@pytest.mark.parametrize("content, match", [
    ("1.5\n", "integer or a string, got float"),
    ("true\n", "integer or a string, got bool"),
    ("abc\n", "line 1 is not JSON"),
    ('{"idx": 3}\n', 'needs an "id" field'),
    ('""\n', "empty string id"),
    ("\n\n", "holds no ids"),
])
def test_bad_jsonl_is_a_clear_error(tmp_path, content, match):
    f = tmp_path / "bad.jsonl"
    f.write_text(content)
    with pytest.raises(UnlearnError, match=match):
        read_ids(f)


def test_bad_json_and_missing_file(tmp_path):
    (tmp_path / "x.json").write_text('{"id": 1}')
    with pytest.raises(UnlearnError, match="must hold a JSON list"):
        read_ids(tmp_path / "x.json")
    with pytest.raises(UnlearnError, match="cannot read the id file"):
        read_ids(tmp_path / "missing.jsonl")


def test_type_mismatch_names_both_types():
    with pytest.raises(UnlearnError, match=r"id '3600' is str but the run uses int ids"):
        check_id_types(["3600"], [1, 2, 3])
    check_id_types([5], [1, 2])  # same type: fine
