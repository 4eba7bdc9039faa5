"""Every file a command writes gets the mode the umask gives it, weights included (safetensors writes its files 0600
itself); only the private files named in PRIVATE are owner-only.

Checked under umask 022 and 027 on a trace recording (full fine-tune and LoRA), an exact deletion published to a
local Hub (the output folder and the Hub's stored copy), and an approximate deletion."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from .test_trace_common import get_trace_data, ids_at_step, record, tiny

# owner-only on purpose, whatever the umask: raw ids, keys and what holds them
PRIVATE = {
    "unlearning_info.json",  # the card info with the raw forget ids (never published)
    "ids.jsonl",  # raw ids of a request
    "key",  # a run's tagging key, a signing key
    "signing_key.pem",
}


def modes_that_differ(root: Path, mask: int) -> dict[str, str]:
    """``{relative path: mode}`` of every file under ``root`` whose mode is not what open() gives under ``mask``
    (private files: not 0600), and of every folder that is not what mkdir() gives (0777 minus the mask). A run's
    private/ folder (its token store) follows the umask like the rest of the run: it is never published."""
    wrong = {}
    for path in sorted(root.rglob("*")):
        if path.is_symlink():
            continue
        rel = path.relative_to(root)
        if path.is_dir():
            expected = 0o777 & ~mask
        else:
            expected = 0o600 if path.name in PRIVATE else 0o666 & ~mask
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode != expected:
            wrong[str(rel)] = oct(mode)
    return wrong


@pytest.fixture(params=[0o022, 0o027], ids=["umask022", "umask027"])
def umask(request):
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def test_recording_and_exact_deletion_published_follow_the_umask(tmp_path, umask):
    from hf_unlearn import forget
    from hf_unlearn.demo import local_hub

    tok, data = get_trace_data()
    record(tok, data, tmp_path / "rec", max_steps=4)
    run = tmp_path / "rec" / "trace"
    weights = list(run.rglob("*.safetensors"))
    assert weights, "the recording wrote no weights"
    with local_hub(tmp_path / "hub") as (server, token):
        receipt = forget(run, ids_at_step(run, 3)[:1], tmp_path / "out", tokenizer=tok, repo="org/tiny",
                         endpoint=server.url, token=token, progress=False, log=lambda m: None)
    assert receipt.ok and receipt.published["verify_ok"]
    assert list((tmp_path / "out").rglob("*.safetensors"))
    for folder in ("rec", "out", "hub"):
        assert modes_that_differ(tmp_path / folder, umask) == {}, folder


def test_lora_recording_follows_the_umask(tmp_path, umask):
    from peft import LoraConfig, get_peft_model

    tok, data = get_trace_data()
    model = get_peft_model(tiny(tok), LoraConfig(r=2, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    record(tok, data, tmp_path / "rec", max_steps=2, model=model)
    assert list((tmp_path / "rec").rglob("*.safetensors"))
    assert modes_that_differ(tmp_path / "rec", umask) == {}


def test_approximate_deletion_follows_the_umask(tmp_path, umask, tiny_llama_dir):
    from hf_unlearn import forget
    from hf_unlearn.data.embedded import load_embedded_tofu

    rows = load_embedded_tofu().select(range(24))
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "question": r["question"], "answer": r["answer"]}) + "\n"
                            for i, r in enumerate(rows)))
    request = tmp_path / "request.txt"
    request.write_text("q1\nq2\n")
    forget(tiny_llama_dir, request, tmp_path / "out", method="grad_ascent", data=str(data), max_steps=1,
           max_retain_rows=4, max_length=48, eval_rows=0, progress=False, log=lambda m: None)
    assert list((tmp_path / "out").rglob("*.safetensors"))
    assert modes_that_differ(tmp_path / "out", umask) == {}
