"""The third round of OpenUnlearning conventions, each pinned against a direct computation: extraction strength's 1/n,
MUSE verbmem's EOS-only cut, privleak's start token, OpenUnlearning's prompt formats (token ids built by hand from the
strings its ``preprocess_chat_instance`` tokenises), and the recovery fraction's threshold."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from hf_unlearn.data.prompts import OU_DATE_STRING, OU_SYSTEM_PROMPT, PromptFormat
from hf_unlearn.data.tokenize import encode_qa
from hf_unlearn.errors import UnlearnError
from hf_unlearn.eval import metrics as M

from .conftest import MUSE_DIR, SHARED, TOFU_DIR, TOKENIZERS

Q, A = "Who wrote Dune?", "The author is Frank Herbert."


# ---------------------------------------------------------------------------------------------------------------
# extraction strength


def _open_unlearning_es(correct) -> float:
    """OpenUnlearning's loop, written out: the first k whose suffix is all correct, the loop variable left at n - 1
    when none is."""
    n = len(correct)
    for k in range(n):
        if all(correct[k:]):
            break
    return 1 - k / n


def test_extraction_strength_zero_or_one_over_n():
    assert M.extraction_strength([False, False, False]) == 0.0
    assert M.extraction_strength([False, False, False], "one_over_n") == pytest.approx(1 / 3)
    assert M.extraction_strength([False, False, True], "one_over_n") == pytest.approx(1 / 3)  # the same score
    assert M.extraction_strength([False, False, True]) == pytest.approx(1 / 3)
    assert M.extraction_strength([True, False, True, True], "one_over_n") == 0.5 == M.extraction_strength(
        [True, False, True, True])
    rng = np.random.default_rng(0)
    for _ in range(200):
        c = list(rng.random(int(rng.integers(1, 9))) < 0.6)
        assert M.extraction_strength(c, "one_over_n") == pytest.approx(_open_unlearning_es(c))
    with pytest.raises(UnlearnError, match="es_no_match"):
        M.extraction_strength([True], "one")


# ---------------------------------------------------------------------------------------------------------------
# prompt formats


@pytest.fixture(scope="module")
def gpt2():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZERS / "gpt2")


LLAMA3_TEMPLATE = (
    "{{- bos_token }}{%- if not date_string is defined %}{%- set date_string = '26 Jul 2024' %}{%- endif %}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}{{- 'Cutting Knowledge Date: December 2023\\n' }}"
    "{{- 'Today Date: ' + date_string + '\\n\\n' }}{{- system_message }}{{- '<|eot_id|>' }}"
    "{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' "
    "+ message['content'] + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
LLAMA2_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} "
                   "[/INST]{% else %} {{ m['content'] }} {{ eos_token }}{% endif %}{% endfor %}")


@pytest.fixture(scope="module")
def llama3_style(gpt2):
    tok = copy.deepcopy(gpt2)
    tok.add_special_tokens({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                            "additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>"]})
    tok.chat_template = LLAMA3_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def llama2_style():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TOKENIZERS / "gpt-neox-20b")
    tok.chat_template = LLAMA2_TEMPLATE
    return tok


def _expected(tok, prompt: str, full: str, special: bool):
    """OpenUnlearning's ids from the strings it tokenises: full conversation, prompt, EOS appended unless last."""
    full_ids = tok(full, add_special_tokens=special)["input_ids"]
    prompt_ids = tok(prompt, add_special_tokens=special)["input_ids"]
    if full_ids[-1] != tok.eos_token_id:
        full_ids = full_ids + [tok.eos_token_id]
    return full_ids, [-100] * len(prompt_ids) + full_ids[len(prompt_ids):]


def test_llama3_style_template_gets_system_prompt_and_date(llama3_style):
    tok = llama3_style
    fmt = PromptFormat.open_unlearning(tok)
    assert (fmt.chat_template, fmt.system_prompt, fmt.date_string, fmt.joint) == (
        True, "You are a helpful assistant.", "10 Apr 2025", True)
    prompt = ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
              "Today Date: 10 Apr 2025\n\nYou are a helpful assistant.<|eot_id|>"
              f"<|start_header_id|>user<|end_header_id|>\n\n{Q}<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\n")
    ids, labels = _expected(tok, prompt, prompt + A + "<|eot_id|>", special=False)
    enc = encode_qa(tok, Q, A, 512, fmt)
    assert enc["input_ids"] == ids and enc["labels"] == labels
    assert fmt.prompt_ids(tok, Q) == tok(prompt, add_special_tokens=False)["input_ids"]
    assert fmt.prompt_text(tok, Q) == prompt
    # hf_unlearn's own format on the same tokenizer: no system line, the template's default date
    own = PromptFormat().prompt_text(tok, Q)
    assert OU_SYSTEM_PROMPT not in own and "26 Jul 2024" in own and OU_DATE_STRING not in own


def test_llama2_style_gets_the_inst_wrapper_without_the_template(llama2_style):
    tok = llama2_style
    fmt = PromptFormat.open_unlearning(tok)
    assert (fmt.chat_template, fmt.user_start, fmt.user_end, fmt.assistant_start) == (False, "[INST] ", " [/INST]", "")
    prompt = f"[INST] {Q} [/INST]"
    ids, labels = _expected(tok, prompt, prompt + A, special=True)  # the answer right after [/INST], no space
    enc = encode_qa(tok, Q, A, 512, fmt)
    assert enc["input_ids"] == ids and enc["labels"] == labels
    assert tok.decode([t for t in enc["labels"] if t != -100]) == "The author is Frank Herbert.<|endoftext|>"


def test_plain_answer_prompt_trailing_space_drops_the_first_answer_token(gpt2):
    fmt = PromptFormat.open_unlearning(gpt2)  # no chat template: a base model's Question/Answer tags
    assert (fmt.chat_template, fmt.assistant_start) == (False, "Answer: ")
    ids, labels = _expected(gpt2, f"Question: {Q}\nAnswer: ", f"Question: {Q}\nAnswer: {A}", special=True)
    enc = encode_qa(gpt2, Q, A, 512, fmt)
    assert enc["input_ids"] == ids and enc["labels"] == labels
    # "Answer: " ends in a token of its own (" "); in the full text the space merged into " The", so the label
    # positions start one token late and "The" is never scored
    assert gpt2.decode([t for t in enc["labels"] if t != -100]) == " author is Frank Herbert.<|endoftext|>"
    # hf_unlearn's format scores every answer token
    own = encode_qa(gpt2, Q, A, 512, False)
    assert own["input_ids"] == gpt2(f"Question: {Q}\nAnswer:")["input_ids"] + gpt2(" " + A)["input_ids"] + [50256]
    assert gpt2.decode([t for t in own["labels"] if t != -100]) == " The author is Frank Herbert.<|endoftext|>"


@pytest.mark.slow  # the real SmolLM2 tokenizer's chat template (~15 s)
def test_smollm2_chat_template_with_the_system_prompt():
    pytest.importorskip("gguf")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(SHARED / "models" / "SmolLM2-135M-Instruct",
                                        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    fmt = PromptFormat.open_unlearning(tok)
    assert (fmt.chat_template, fmt.system_prompt, fmt.date_string) == (True, OU_SYSTEM_PROMPT, None)
    prompt = (f"<|im_start|>system\n{OU_SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n{Q}<|im_end|>\n"
              "<|im_start|>assistant\n")
    ids, labels = _expected(tok, prompt, prompt + A + "<|im_end|>\n", special=False)
    enc = encode_qa(tok, Q, A, 512, fmt)
    assert enc["input_ids"] == ids and enc["labels"] == labels
    # the template ends the turn with "<|im_end|>\n"; OpenUnlearning appends EOS after it
    assert tok.decode([t for t in enc["labels"] if t != -100]) == A + "<|im_end|>\n<|im_end|>"
    # hf_unlearn's: the template's own default system line, the answer tokenised alone
    own = encode_qa(tok, Q, A, 512)
    assert "You are a helpful AI assistant named SmolLM" in tok.decode(own["input_ids"])
    assert tok.decode([t for t in own["labels"] if t != -100]) == A + "<|im_end|>"


def test_prompt_format_specs_and_errors(gpt2):
    from hf_unlearn.data.prompts import prompt_format

    assert prompt_format(None) == PromptFormat() and prompt_format(True).chat_template is True
    assert prompt_format(PromptFormat.open_unlearning(gpt2).to_dict()) == PromptFormat.open_unlearning(gpt2)
    with pytest.raises(UnlearnError, match="pass the tokenizer"):
        prompt_format("open-unlearning")
    with pytest.raises(UnlearnError, match="one of"):
        prompt_format("llama")
    with pytest.raises(UnlearnError, match="has none"):
        PromptFormat(chat_template=True).prompt_text(gpt2, Q)


@pytest.mark.slow  # two TOFU evaluations (~9 s); the preset test beside it refuses a mixed reference too
def test_evaluate_tofu_records_the_format_and_refuses_a_mixed_reference():
    from hf_unlearn.eval.tofu import evaluate_tofu
    from hf_unlearn.models import build_tiny_model, load_tokenizer

    tok = load_tokenizer(TOKENIZERS / "gpt2")
    model = build_tiny_model("llama", tok, hidden_size=32, num_layers=2, num_heads=2)
    kw = dict(max_items=2, max_new_tokens=2, progress=False, tofu_path=TOFU_DIR, mia_attacks=["loss"])
    own = evaluate_tofu(model, tok, **kw)
    ou = evaluate_tofu(model, tok, prompt_format="open-unlearning", es_no_match="one_over_n", **kw)
    assert ou.meta["prompt_format"]["assistant_start"] == "Answer: " and ou.meta["es_no_match"] == "one_over_n"
    assert own.meta["prompt_format"] == PromptFormat(chat_template=False).to_dict()
    assert ou.summary["forget_probability"] != own.summary["forget_probability"]
    for r in ou.per_item:  # every ES is at least 1/n of its scored answer
        if r["set"] == "forget":
            assert r["extraction_strength"] > 0
    with pytest.raises(UnlearnError, match="prompt_format"):
        evaluate_tofu(model, tok, reference=ou, **{**kw, "es_no_match": "one_over_n"})
    with pytest.raises(UnlearnError, match="es_no_match"):
        evaluate_tofu(model, tok, reference=ou, prompt_format="open-unlearning", **kw)


# ---------------------------------------------------------------------------------------------------------------
# MUSE


def test_privleak_keeps_max_length_text_tokens_after_the_start_token():
    from transformers import AutoTokenizer

    from hf_unlearn.eval.muse import privleak_encoding

    text = "The quick brown fox jumps over the lazy dog. " * 20
    with_bos = AutoTokenizer.from_pretrained(TOKENIZERS / "gpt2", add_bos_token=True)
    plain = AutoTokenizer.from_pretrained(TOKENIZERS / "gpt2")
    body = plain(text, add_special_tokens=False)["input_ids"]
    enc = privleak_encoding(with_bos, text, 16)
    assert enc["input_ids"] == [with_bos.bos_token_id] + body[:16]  # OpenUnlearning: prefix_len + max_length
    assert enc["labels"] == [-100] + body[:16]
    enc = privleak_encoding(plain, text, 16)  # no start token: 16 tokens, the first never a target
    assert enc["input_ids"] == body[:16] and enc["labels"] == [-100] + body[1:16]


def test_a_muse_reference_from_before_the_start_token_fix_is_refused():
    from transformers import AutoTokenizer

    from hf_unlearn.eval.muse import MuseResult, evaluate_muse_news
    from hf_unlearn.eval.runner import tokenizer_fingerprint

    tok = AutoTokenizer.from_pretrained(TOKENIZERS / "gpt2", add_bos_token=True)
    old = MuseResult({"mia_min_k_auc": 0.6}, [], {"tokenizer_fingerprint": tokenizer_fingerprint(tok),
                                                  "max_length": 2048, "mia_k": 0.4})
    with pytest.raises(UnlearnError, match="after the start token"):
        evaluate_muse_news(None, tok, reference=old, muse_path=MUSE_DIR, progress=False)


def test_verbmem_eos_only_generates_the_full_budget():
    from hf_unlearn.eval.muse import evaluate_muse_news
    from hf_unlearn.eval.runner import generate_texts
    from hf_unlearn.models import build_tiny_model, load_tokenizer

    tok = load_tokenizer(TOKENIZERS / "gpt2")
    model = build_tiny_model("llama", tok, hidden_size=32, num_layers=2, num_heads=2)
    kw = dict(muse_path=MUSE_DIR, max_items=2, max_length=32, max_prompt_tokens=32, verbmem_max_new_tokens=12,
              knowmem_max_new_tokens=2, mia_attacks=["loss"], progress=False)
    eos = evaluate_muse_news(model, tok, verbmem_stop="eos", **kw)
    cut = evaluate_muse_news(model, tok, **kw)
    rows = [r for r in eos.per_item if r["set"] == "verbmem"]
    from hf_unlearn.data.muse import load_muse_news

    data = load_muse_news("verbmem", "forget", MUSE_DIR).to_list()[:2]
    prompts = [tok(r["prompt"])["input_ids"][-32:] for r in data]
    direct = generate_texts(model, tok, prompts, max_new_tokens=12, progress=False)
    assert [r["generation"] for r in rows] == direct
    assert [r["rouge_l_f1"] for r in rows] == [M.rouge_l_f1(g, d["gt"]) for g, d in zip(direct, data)]
    assert eos.meta["verbmem_stop"] == "eos" and cut.meta["verbmem_stop"] == "ground_truth"
    with pytest.raises(UnlearnError, match="verbmem_stop"):
        evaluate_muse_news(model, tok, verbmem_stop="gt", **kw)


# ---------------------------------------------------------------------------------------------------------------
# recovery fraction


def test_recovery_is_not_computed_below_the_threshold():
    from hf_unlearn.eval.robustness import RobustnessResult, recovery, recovery_fraction

    tiny = recovery(0.98, 0.99999, 1.0)
    assert tiny["recovery"] is None and tiny["removed"] == pytest.approx(1e-5)
    assert "removed 1e-05 < 0.01" in tiny["recovery_note"]
    assert recovery_fraction(0.98, 0.99999, 1.0) is None
    assert recovery_fraction(0.98, 0.99999, 1.0, min_removed=1e-6) == pytest.approx(-1999.0, rel=1e-6)
    ok = recovery(0.5, 0.2, 0.8)
    assert ok == {"recovery": pytest.approx(0.5), "removed": pytest.approx(0.6), "recovery_note": None}
    assert recovery(0.5, 0.2, None)["recovery_note"].startswith("no model before")
    point = {"step": 0, "probability": 0.99999, **tiny}
    result = RobustnessResult({"steps": [0], "models": {"model": {"forget": {"probability": 0.9}, "relearning": [
        point], "in_context": {"probability": 0.5, **ok}}}}, [], {"relearn_on": "half", "in_context_rows": 4})
    table = result.to_markdown()
    assert "not computed: unlearning removed 1e-05 < 0.01" in table
    assert "0.5 (0.5 of 0.6)" in table and "in-context, 4 forget QA pairs" in table


def test_recovery_plot_marks_an_uncomputed_fraction(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.axes

    from hf_unlearn.eval.plots import plot_recovery_curves
    from hf_unlearn.eval.robustness import RobustnessResult, recovery

    labels = []
    original = matplotlib.axes.Axes.plot

    def spy(self, *args, label=None, **kw):
        labels.append(label)
        return original(self, *args, label=label, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", spy)
    points = [{"step": k, "probability": 0.99999, **recovery(p, 0.99999, 1.0)} for k, p in ((0, 0.99999), (5, 0.98))]
    good = [{"step": k, "probability": p, **recovery(p, 0.2, 0.8)} for k, p in ((0, 0.2), (5, 0.5))]
    result = RobustnessResult({"steps": [0, 5], "models": {"model": {"relearning": points},
                                                           "exact": {"relearning": good}}}, [], {})
    assert plot_recovery_curves(result, tmp_path / "r.png").exists()
    assert "model: not computed (unlearning removed 1e-05 < 0.01)" in labels and "exact" in labels


# ---------------------------------------------------------------------------------------------------------------
# the command line's copies of the library's names


def test_cli_choices_match_the_library():
    from hf_unlearn.commands import eval as cli
    from hf_unlearn.data.prompts import PROMPT_FORMATS
    from hf_unlearn.eval.muse import VERBMEM_STOPS
    from hf_unlearn.eval.robustness import ATTACKS

    assert (cli.PROMPT_FORMATS, cli.ES_NO_MATCH, cli.VERBMEM_STOPS, cli.ATTACKS) == (
        PROMPT_FORMATS, M.ES_NO_MATCH, VERBMEM_STOPS, ATTACKS)


def test_training_tokenises_raw_rows_with_the_configured_prompt_format():
    """UnlearningConfig(prompt_format="open-unlearning") (set by training_preset) tokenises raw QA rows exactly as
    encode_qa with OpenUnlearning's format does; the default keeps hf_unlearn's."""
    from datasets import Dataset

    from hf_unlearn.methods.baselines import GradAscentConfig, GradAscentTrainer
    from hf_unlearn.models import build_tiny_model, load_tokenizer

    tok = load_tokenizer(TOKENIZERS / "gpt2")
    rows = Dataset.from_list([{"id": 1, "question": Q, "answer": A}, {"id": 2, "question": "Why?", "answer": "So."}])
    for fmt, expected in (("open-unlearning", PromptFormat.open_unlearning(tok)), ("hf-unlearn", PromptFormat())):
        config = GradAscentConfig(output_dir="unused", report_to=[], max_length=64, prompt_format=fmt, use_cpu=True)
        trainer = GradAscentTrainer(model=build_tiny_model("llama", tok, hidden_size=32, num_layers=2, num_heads=2),
                                    args=config, forget_dataset=rows, processing_class=tok)
        for row, r in zip(trainer.train_dataset, rows):
            enc = encode_qa(tok, r["question"], r["answer"], 64, expected)
            assert row["input_ids"] == enc["input_ids"] and row["labels"] == enc["labels"]
    with pytest.raises(UnlearnError, match="prompt_format"):
        GradAscentConfig(output_dir="unused", report_to=[], prompt_format="llama")


def test_tofu_reference_trains_with_the_format_it_is_evaluated_with(monkeypatch, tmp_path):
    import hf_unlearn.data
    from hf_unlearn.eval.reference import train_retain_reference
    from hf_unlearn.models import load_tokenizer

    tok = load_tokenizer(TOKENIZERS / "gpt2")
    seen = []

    class Stop(Exception):
        pass

    def spy(dataset, tokenizer, max_length=256, use_chat_template=None, **kw):
        seen.append(use_chat_template)
        raise Stop

    monkeypatch.setattr(hf_unlearn.data, "tokenize_qa", spy)
    for fmt in ("open-unlearning", None):
        with pytest.raises(Stop):
            train_retain_reference(None, tok, forget_split="forget01", output_dir=tmp_path, tofu_path=TOFU_DIR,
                                   prompt_format=fmt, progress=False)
    assert seen == [PromptFormat.open_unlearning(tok), PromptFormat(chat_template=False)]


# ---------------------------------------------------------------------------------------------------------------
# the attention mask: OpenUnlearning's collator builds it as input_ids != pad, with pad = EOS where a tokenizer has
# none, so EOS tokens closing the turns of a chat prompt are masked (training and evaluation)


def _llama3_model(tok):
    from .test_trace_common import config_model

    return config_model("llama", tok).eval()  # 2 heads sharing 1 key/value head, seeded


def _direct_nll(model, ids: list[int], labels: list[int], pad: int) -> float:
    """Mean answer NLL of one sequence with OpenUnlearning's mask, computed here: ``input_ids != pad``."""
    import torch

    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids=x, attention_mask=x.ne(pad).long()).logits[0, :-1]
    target = torch.tensor(labels[1:])
    keep = target != -100
    return float(torch.nn.functional.cross_entropy(logits[keep], target[keep]))


def test_not_pad_mask_is_input_ids_ne_pad_in_the_collator_scoring_and_generation(llama3_style):
    import torch

    from hf_unlearn.data.collators import QACollator
    from hf_unlearn.eval.runner import generate_texts, pad_token_id, score_sequences

    tok = llama3_style
    pad = pad_token_id(tok)  # no pad token: EOS (<|eot_id|>), as OpenUnlearning sets it
    assert tok.pad_token_id is None and pad == tok.eos_token_id
    fmt = PromptFormat.open_unlearning(tok)
    encs = [encode_qa(tok, Q, A, 512, fmt), encode_qa(tok, "Why?", "Because.", 512, fmt)]
    assert encs[0]["input_ids"][:-1].count(pad) == 2  # the system and user turns end with EOS inside the prompt
    batch = QACollator(pad_token_id=pad, attention_mask="not_pad")([dict(e) for e in encs])
    assert torch.equal(batch["attention_mask"], batch["input_ids"].ne(pad).long())
    own = QACollator(pad_token_id=pad)([dict(e) for e in encs])
    assert own["attention_mask"][0].tolist() == [1] * len(encs[0]["input_ids"])
    model = _llama3_model(tok)
    ou = score_sequences(model, encs, pad_id=pad, progress=False, attention_mask="not_pad")
    for st, e in zip(ou, encs):
        assert st.mean_nll == pytest.approx(_direct_nll(model, e["input_ids"], e["labels"], pad), abs=1e-5)
    mine = score_sequences(model, encs, pad_id=pad, progress=False)
    assert abs(mine[0].mean_nll - ou[0].mean_nll) > 1e-4  # masking the turn ends changes what the model sees
    prompts = [fmt.prompt_ids(tok, Q), fmt.prompt_ids(tok, "Why?")]
    generated = generate_texts(model, tok, prompts, max_new_tokens=4, progress=False, attention_mask="not_pad")
    length = max(map(len, prompts))
    ids = torch.tensor([[pad] * (length - len(p)) + p for p in prompts])
    direct = model.generate(input_ids=ids, attention_mask=ids.ne(pad).long(), do_sample=False, max_new_tokens=4,
                            pad_token_id=pad, eos_token_id=tok.eos_token_id)
    assert generated == [tok.decode(row[length:], skip_special_tokens=True).strip() for row in direct]
    with pytest.raises(UnlearnError, match="attention_mask"):
        QACollator(pad_token_id=pad, attention_mask="eos")


def test_tofu_under_the_preset_masks_as_open_unlearning_and_refuses_a_mixed_reference(llama3_style):
    from hf_unlearn.eval.tofu import evaluate_tofu
    from hf_unlearn.presets import evaluation_preset

    tok = llama3_style
    model = _llama3_model(tok)
    kw = dict(max_items=2, max_new_tokens=2, progress=False, tofu_path=TOFU_DIR, mia_attacks=["loss"])
    ou = evaluate_tofu(model, tok, **kw, **evaluation_preset("open-unlearning", "tofu"))
    assert ou.meta["attention_mask"] == "not_pad"
    fmt = PromptFormat.open_unlearning(tok)
    first = next(r for r in ou.per_item if r["set"] == "forget")
    enc = encode_qa(tok, first["question"], first["answer"], 512, fmt)
    assert first["mean_nll"] == pytest.approx(_direct_nll(model, enc["input_ids"], enc["labels"], tok.eos_token_id),
                                              abs=1e-5)
    own = evaluate_tofu(model, tok, **kw, **{**evaluation_preset("open-unlearning", "tofu"), "attention_mask": "tokens"})
    assert own.summary["forget_probability"] != ou.summary["forget_probability"]
    with pytest.raises(UnlearnError, match="attention_mask"):
        evaluate_tofu(model, tok, reference=own, **kw, **evaluation_preset("open-unlearning", "tofu"))


def test_training_under_the_preset_collates_with_open_unlearnings_mask(llama3_style):
    from datasets import Dataset

    from hf_unlearn.methods.baselines import GradAscentConfig, GradAscentTrainer
    from hf_unlearn.presets import training_preset

    tok = copy.deepcopy(llama3_style)
    tok.pad_token = tok.eos_token  # as load_tokenizer (and OpenUnlearning) set it
    rows = Dataset.from_list([{"id": 1, "question": Q, "answer": A}, {"id": 2, "question": "Why?", "answer": "So."}])
    config = GradAscentConfig(output_dir="unused", report_to=[], use_cpu=True,
                              **{k: v for k, v in training_preset("open-unlearning", "grad_ascent").items()
                                 if k in ("attention_mask", "prompt_format", "max_length")})
    trainer = GradAscentTrainer(model=_llama3_model(tok), args=config, forget_dataset=rows, processing_class=tok)
    batch = trainer.data_collator([{k: r[k] for k in ("input_ids", "attention_mask", "labels")}
                                   for r in trainer.train_dataset])
    assert (batch["attention_mask"] == 0).sum() > (batch["input_ids"] == tok.eos_token_id).sum() // 2
    assert batch["attention_mask"].tolist() == batch["input_ids"].ne(tok.eos_token_id).long().tolist()
    with pytest.raises(UnlearnError, match="attention_mask"):
        GradAscentConfig(output_dir="unused", report_to=[], attention_mask="all")


# ---------------------------------------------------------------------------------------------------------------
# the MUSE verbmem prompt: OpenUnlearning keeps it whole, start token included


def test_verbmem_prompt_is_kept_whole_under_the_preset_and_a_cut_keeps_the_start_token(monkeypatch):
    from transformers import AutoTokenizer

    import hf_unlearn.eval.runner as runner
    from hf_unlearn.data.muse import load_muse_news
    from hf_unlearn.eval.muse import evaluate_muse_news, verbmem_prompt
    from hf_unlearn.presets import evaluation_preset

    tok = AutoTokenizer.from_pretrained(TOKENIZERS / "gpt2", add_bos_token=True)
    data = load_muse_news("verbmem", "forget", MUSE_DIR).to_list()[:2]
    seen = []

    class Stop(Exception):
        pass

    def spy(model, tokenizer, prompts, **kw):
        seen.append([list(p) for p in prompts])
        raise Stop

    monkeypatch.setattr(runner, "generate_texts", spy)
    for conventions in (evaluation_preset("open-unlearning", "muse_news"), {"max_prompt_tokens": 64}):
        with pytest.raises(Stop):
            evaluate_muse_news(None, tok, muse_path=MUSE_DIR, max_items=2, progress=False, **conventions)
    whole = [tok(r["prompt"], add_special_tokens=True)["input_ids"] for r in data]  # OpenUnlearning's prefix_ids
    assert seen[0] == whole and whole[0][0] == tok.bos_token_id and len(whole[0]) > 800
    assert seen[1] == [[tok.bos_token_id] + w[-63:] for w in whole]  # the cut drops the oldest text, not BOS
    assert verbmem_prompt(tok, data[0]["prompt"], None) == whole[0] == verbmem_prompt(tok, data[0]["prompt"], 4096)
    with pytest.raises(UnlearnError, match="max_prompt_tokens"):
        evaluate_muse_news(None, tok, muse_path=MUSE_DIR, max_prompt_tokens=0, progress=False)


@pytest.mark.slow
def test_smollm2_attention_mask_effect_under_the_preset():
    """SmolLM2's pad token is its end-of-turn <|im_end|>: under OpenUnlearning's mask the chat prompt's turn ends are
    hidden. The forget probability of the first 40 TOFU forget10 rows with each mask (printed: the figure
    docs/evaluation.md quotes), the not_pad one pinned on a row by the direct computation."""
    from hf_unlearn.eval.tofu import evaluate_tofu
    from hf_unlearn.models import load_model, load_tokenizer
    from hf_unlearn.presets import evaluation_preset

    from .conftest import SMOLLM2_DIR

    model, tok = load_model(SMOLLM2_DIR), load_tokenizer(SMOLLM2_DIR)
    assert tok.pad_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    kw = dict(forget_split="forget10", tofu_path=TOFU_DIR, mia_attacks=["loss"], max_new_tokens=32, batch_size=8,
              progress=False, max_items={"forget": 40, "retain": 1, "real_authors": 1, "world_facts": 1, "holdout": 1})
    preset = evaluation_preset("open-unlearning", "tofu")
    ou = evaluate_tofu(model, tok, **kw, **preset)
    own = evaluate_tofu(model, tok, **kw, **{**preset, "attention_mask": "tokens"})
    gens = [[r["generation"] for r in res.per_item if r["set"] == "forget"] for res in (ou, own)]
    changed = sum(a != b for a, b in zip(*gens))
    print(f"SmolLM2-135M-Instruct, forget10 first 40 rows, --preset open-unlearning: forget probability "
          f"{ou.summary['forget_probability']:.4f} (not_pad) vs {own.summary['forget_probability']:.4f} (tokens); "
          f"{changed} of {len(gens[0])} generations differ")
    first = next(r for r in ou.per_item if r["set"] == "forget")
    enc = encode_qa(tok, first["question"], first["answer"], 512, PromptFormat.open_unlearning(tok))
    assert first["mean_nll"] == pytest.approx(_direct_nll(model, enc["input_ids"], enc["labels"], tok.pad_token_id),
                                              rel=1e-4)
    assert abs(ou.summary["forget_probability"] - own.summary["forget_probability"]) > 0.005
