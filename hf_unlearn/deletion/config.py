"""The contract of a :func:`~hf_unlearn.deletion.forget` call: its options (:class:`ForgetConfig`, from which
``hf-unlearn forget`` generates its flags), the method names it knows, and the names of what it writes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..errors import UnlearnError

RECEIPT_FILE = "receipt.json"
RECEIPT_FORMAT = "hf_unlearn.forget_receipt.v1"
EXACT = "exact"
DEFAULT_APPROXIMATE = "masc"
COMMON_METHOD_ARGS = {"retain_loss": str, "lambda_forget": float, "lambda_retain": float}

# the short spellings of some options on the command line (``hf-unlearn forget`` adds them; refusals name them)
ALIASES = {"learning_rate": ("--lr",), "num_train_epochs": ("--epochs",), "tofu_path": ("--tofu",),
           "tokenizer_path": ("--tokenizer",)}


@dataclass
class ForgetConfig:
    """Options of :func:`forget` (and of ``hf-unlearn forget``, which is generated from these fields)."""

    output_dir: str = field(metadata={"help": "output folder (new or empty): model/, receipt.json and the evidence"})
    method: str | None = field(default=None, metadata={
        "help": "'exact' (needs a recorded run; the default for one) or an approximate method of the registry "
                "(default for a model: masc)"})
    data: str | None = field(default=None, metadata={
        "help": "rows the ids refer to, for approximate methods: 'tofu' (TOFU full; the default), 'tofu-subset' (the "
                "10 authors shipped with the package), a .jsonl/.json/.parquet/.csv file or a save_to_disk folder "
                "with question/answer (or input_ids/labels) and an id column; from Python also a datasets.Dataset"})
    tofu_path: str | None = field(default=None, metadata={
        "help": "local TOFU folder for data='tofu' (default: $HF_UNLEARN_DATA_DIR/tofu, else the Hub)"})
    id_column: str = field(default="id", metadata={"help": "the data's id column (default id)"})
    tokenizer_path: str | None = field(default=None, metadata={
        "help": "exact: tokenizer (folder or Hub id) saved with the model, which a recorded run does not hold (from "
                "Python, tokenizer= takes the object)"})
    collator: str | None = field(default=None, metadata={
        "help": "exact: the run's data collator when the trace cannot rebuild it: module:name (the collator) or "
                "module:name() (a factory); from Python, data_collator= takes the object"})
    oracle: bool = field(default=False, metadata={
        "help": "exact: also run the trace oracle (a full replay from step 0 on the original store) and check the "
                "replay against it bit for bit"})
    learning_rate: float | None = field(default=None, metadata={
        "help": "approximate: learning rate (default 1e-5, also with the preset)"})
    num_train_epochs: float | None = field(default=None, metadata={
        "help": "approximate: epoch budget over the forget rows (a cap for methods that stop themselves; default 5, "
                "10 with --preset open-unlearning)"})
    max_steps: int = field(default=-1, metadata={"help": "approximate: step budget (default: num_train_epochs)"})
    batch_size: int | None = field(default=None, metadata={
        "help": "approximate: forget (and retain) rows per step (default 4, 8 with --preset open-unlearning)"})
    max_length: int | None = field(default=None, metadata={
        "help": "approximate: tokens per QA pair (default 256, 512 with --preset open-unlearning)"})
    preset: str | None = field(default=None, metadata={
        "help": "approximate: 'open-unlearning' = OpenUnlearning's budget, conventions and method defaults "
                "(hf_unlearn.presets); options given explicitly win, also when equal to the default"})
    lora: bool = field(default=False, metadata={"help": "approximate: train a LoRA adapter, merged into the saved model"})
    lora_r: int = field(default=8, metadata={"help": "approximate: LoRA rank (default 8)"})
    seed: int = field(default=0, metadata={"help": "seed for training and the retain sample (default 0)"})
    method_args: dict[str, Any] = field(default_factory=dict, metadata={
        "help": "approximate: method options as KEY=VALUE (the method's own options, e.g. alpha=0.2 for masc, and "
                "retain_loss, lambda_forget, lambda_retain)"})
    max_retain_rows: int | None = field(default=400, metadata={
        "help": "approximate: retained rows used as the retain set, a seeded sample (default 400; 0 = all)"})
    eval_rows: int = field(default=40, metadata={
        "help": "rows evaluated before and after on each side (forget, retained sample; default 40; 0 = no "
                "evaluation)"})
    max_new_tokens: int = field(default=48, metadata={"help": "tokens generated per answer for ROUGE-L (default 48)"})
    repo: str | None = field(default=None, metadata={
        "help": "publish to this Hub repo (org/name) as the next deletion-NNNN tag, then download and verify it"})
    private: bool = field(default=False, metadata={"help": "create the Hub repo private"})
    token: str | None = field(default=None, metadata={"help": "Hub token (default: HF_TOKEN or the saved login)"})
    endpoint: str | None = field(default=None, metadata={"help": "Hub URL (default: HF_ENDPOINT or huggingface.co)"})
    base_model: str | None = field(default=None, metadata={"help": "Hub id of the base model, for the card"})
    datasets: list[str] | None = field(default=None, metadata={"help": "dataset Hub ids for the card"})
    overwrite: bool = field(default=False, metadata={
        "help": "replace an earlier output of this command in output_dir (one whose receipt.json is a forget receipt)"})
    progress: bool = field(default=True, metadata={"help": "progress bars on every long stage"})
    accept_unproven: bool = field(default=False, metadata={
        "help": "exact: delete even where the run's steps are not proven to be reproduced by the engine (`hf-unlearn "
                "trace prove RUN` proves them); the receipt names the unproven steps and the deletion is never "
                "VERIFIED"})


def parse_method_args(pairs: Iterable[str] | None) -> dict[str, str]:
    """``["alpha=0.2", "k=5"]`` -> ``{"alpha": "0.2", "k": "5"}`` (types are applied per method later)."""
    out = {}
    for pair in pairs or ():
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise UnlearnError(f"method option {pair!r} must be KEY=VALUE, e.g. alpha=0.2")
        out[key.strip()] = value.strip()
    return out
