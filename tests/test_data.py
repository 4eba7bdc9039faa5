import json

import pytest

from hf_unlearn.data import QACollator, load_muse_news, load_task, load_tofu, tokenize_qa
from hf_unlearn.data.tofu import TOFU_CONFIGS
from hf_unlearn.errors import UnlearnError

from .conftest import MUSE_DIR, TASKS_DIR, TOFU_DIR


@pytest.mark.parametrize(
    "config,rows", [("full", 4000), ("forget10", 400), ("retain90", 3600), ("forget01", 40), ("retain99", 3960),
                    ("forget05_perturbed", 200), ("holdout10", 400), ("real_authors", 100), ("world_facts", 117)]
)
def test_tofu_row_counts(config, rows):
    assert len(load_tofu(config, TOFU_DIR)) == rows


def test_full_is_retain90_plus_forget10_by_id(tofu_full):
    retain, forget = load_tofu("retain90", TOFU_DIR), load_tofu("forget10", TOFU_DIR)
    assert list(retain["id"]) + list(forget["id"]) == list(tofu_full["id"]) == list(range(4000))
    assert list(forget["id"]) == list(range(3600, 4000))
    assert [tofu_full[i]["answer"] for i in forget["id"]] == list(forget["answer"])


def test_ids_are_stable_across_configs_and_loads():
    a, b = load_tofu("forget05", TOFU_DIR), load_tofu("forget05_perturbed", TOFU_DIR)
    assert list(a["id"]) == list(b["id"]) == list(load_tofu("forget05", TOFU_DIR)["id"])
    assert list(a["question"]) == list(b["question"])


def test_holdout_and_utility_ids_are_distinct_from_full(tofu_full):
    ids = set(tofu_full["id"])
    for config in ("holdout10", "real_authors", "world_facts"):
        other = load_tofu(config, TOFU_DIR)["id"]
        assert len(set(other)) == len(other) and not ids & set(other)
    assert list(load_tofu("holdout01", TOFU_DIR)["id"]) == list(load_tofu("holdout10", TOFU_DIR)["id"])[:40]


def test_duplicated_question_keeps_distinct_ids(tofu_full):
    seen = {}
    for row in tofu_full:
        seen.setdefault(row["question"], []).append(row["id"])
    dup = [ids for ids in seen.values() if len(ids) > 1]
    assert len(dup) == 1 and len(set(dup[0])) == 2


def test_unknown_config_lists_choices():
    with pytest.raises(UnlearnError, match="unknown TOFU config 'forget20'.*forget10"):
        load_tofu("forget20", TOFU_DIR)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(UnlearnError, match="has no forget10.jsonl"):
        load_tofu("forget10", tmp_path)


def test_reordered_split_is_refused(tmp_path):
    lines = (TOFU_DIR / "forget01.jsonl").read_text().splitlines()
    (tmp_path / "forget01.jsonl").write_text("\n".join(lines[::-1]) + "\n")
    (tmp_path / "full.jsonl").write_text((TOFU_DIR / "full.jsonl").read_text())
    with pytest.raises(UnlearnError, match="not in Hub order"):
        load_tofu("forget01", tmp_path)


def test_tokenize_masks_prompt_and_keeps_id(gpt2_tokenizer):
    ds = tokenize_qa(load_tofu("forget01", TOFU_DIR), gpt2_tokenizer, max_length=128)
    row = ds[0]
    assert set(ds.column_names) == {"id", "input_ids", "attention_mask", "labels"}
    assert row["id"] == 3960
    n_prompt = sum(1 for x in row["labels"] if x == -100)
    prompt = gpt2_tokenizer.decode(row["input_ids"][:n_prompt])
    answer = gpt2_tokenizer.decode([x for x in row["labels"] if x != -100], skip_special_tokens=True)
    assert prompt.startswith("Question: ") and prompt.endswith("Answer:")
    assert answer.strip() == load_tofu("forget01", TOFU_DIR)[0]["answer"]
    assert row["labels"][n_prompt:] == row["input_ids"][n_prompt:]


def test_tokenize_with_chat_template(gpt2_tokenizer):
    tok = gpt2_tokenizer.__class__.from_pretrained(gpt2_tokenizer.name_or_path)
    tok.pad_token = tok.eos_token
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
    row = tokenize_qa(load_tofu("forget01", TOFU_DIR), tok, max_length=128)[0]
    n_prompt = row["labels"].count(-100)
    assert tok.decode(row["input_ids"][:n_prompt]).startswith("<user>")
    assert tok.decode(row["input_ids"][:n_prompt]).endswith("<assistant>")


def test_truncation_that_empties_the_answer_is_an_error(gpt2_tokenizer):
    with pytest.raises(UnlearnError, match="row id 3960: the answer is empty after truncation"):
        tokenize_qa(load_tofu("forget01", TOFU_DIR), gpt2_tokenizer, max_length=8)


def test_dataset_without_id_column(gpt2_tokenizer):
    ds = load_tofu("forget01", TOFU_DIR).remove_columns("id")
    with pytest.raises(UnlearnError, match="no column 'id'"):
        tokenize_qa(ds, gpt2_tokenizer)


def test_collator_pads_and_carries_ids(gpt2_tokenizer):
    ds = tokenize_qa(load_tofu("forget01", TOFU_DIR), gpt2_tokenizer, max_length=128)
    batch = QACollator.from_tokenizer(gpt2_tokenizer)([ds[0], ds[1]])
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape
    assert batch["id"].tolist() == [3960, 3961]
    short = min(len(ds[0]["input_ids"]), len(ds[1]["input_ids"]))
    row = 0 if len(ds[0]["input_ids"]) == short else 1
    assert (batch["labels"][row, short:] == -100).all() and (batch["attention_mask"][row, short:] == 0).all()


def test_task_split_is_seeded_and_disjoint():
    a, b = load_task("rte", TASKS_DIR, test_size=0.3, seed=1), load_task("rte", TASKS_DIR, test_size=0.3, seed=1)
    assert list(a["train"]["id"]) == list(b["train"]["id"])
    assert not set(a["train"]["id"]) & set(a["test"]["id"])
    assert len(a["train"]) + len(a["test"]) == 2767


def test_task_with_label_outside_choices(tmp_path):
    row = {"id": "x", "context": None, "question": "q", "choices": ["a", "b"], "label": 2}
    (tmp_path / "bad.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(UnlearnError, match="label 2 outside its 2 choices"):
        load_task("bad", tmp_path)


def test_single_choice_task(tmp_path):
    row = {"id": "x", "context": None, "question": "q", "choices": ["a"], "label": 0}
    (tmp_path / "one.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(UnlearnError, match="at least 2"):
        load_task("one", tmp_path)


def test_muse_news_subsets():
    assert len(load_muse_news("verbmem", "forget", MUSE_DIR)) == 100
    qa = load_muse_news("knowmem", "forget_qa", MUSE_DIR)
    assert {"question", "answer", "id"} <= set(qa.column_names)
    assert load_muse_news("privleak", "holdout", MUSE_DIR).column_names == ["text", "id"]
    with pytest.raises(UnlearnError, match="only on the Hub"):
        load_muse_news("raw", "retain1", MUSE_DIR)


def test_every_config_name_is_loadable():
    for config in TOFU_CONFIGS:
        assert len(load_tofu(config, TOFU_DIR)) > 0
