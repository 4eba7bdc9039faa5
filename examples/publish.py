"""Publish an unlearned model with its card and state hashes, then verify it from a fresh download.

A toy unlearning trainer (a few steps of gradient ascent on TOFU ``forget01``) uses ``UnlearningHubMixin``, so
``trainer.push_to_hub(repo, deletion=True)`` uploads weights, tokenizer, ``state_hashes.json``, the forget request
as keyed tags and the model card in one commit tagged ``deletion-NNNN``; ``verify_on_hub`` then downloads the
revision, recomputes every hash, loads the model, and checks it against the commit and the state-dict root the push
returned (values the repository cannot rewrite). Its ``statement`` says what that proved.

    python examples/publish.py --local-hub                    # offline: a local Hub-compatible server
    accelerate launch examples/publish.py --local-hub         # same, under accelerate
    HF_TOKEN=... python examples/publish.py --repo you/tiny-unlearned --model HuggingFaceTB/SmolLM2-135M-Instruct

With ``--local-hub`` the server is started (on the main process) BEFORE huggingface_hub is imported, because
huggingface_hub reads ``HF_ENDPOINT`` once, at import time.
"""

from __future__ import annotations

import argparse
import os
import tempfile


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repo", default="hf-unlearn/tiny-llama-unlearned", help="ORG/NAME to publish to")
    p.add_argument("--model", default=None, help="model to unlearn (default: a tiny Llama built locally)")
    p.add_argument("--tokenizer", default="../shared/tokenizers/gpt2", help="tokenizer for the tiny model")
    p.add_argument("--tofu", default=None, help="local TOFU folder (default: $HF_UNLEARN_DATA_DIR/tofu or the Hub)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--output-dir", default=None)
    p.add_argument("--local-hub", action="store_true", help="publish to a local Hub-compatible server")
    return p.parse_args()


def start_local_hub():
    """Start a local hub and point this process's huggingface_hub at it (call before importing it)."""
    from hf_unlearn.hub.server import HubServer

    token = "hf_local_example_token"
    server = HubServer(tempfile.mkdtemp(prefix="hf_unlearn_hub_"), {token: "example"}).start()
    os.environ.update(HF_ENDPOINT=server.url, HF_TOKEN=token, HF_HUB_DISABLE_XET="1", HF_HUB_OFFLINE="0",
                      HF_HOME=tempfile.mkdtemp(prefix="hf_home_"))
    print(f"local hub at {server.url}")
    return server


def main():
    args = parse_args()
    is_main = int(os.environ.get("RANK", "0")) == 0
    server = start_local_hub() if args.local_hub and is_main else None
    if args.local_hub:
        os.environ.setdefault("HF_UNLEARN_DATA_DIR", os.path.join(os.path.dirname(__file__), "..", "..", "shared",
                                                                  "data"))

    from hf_unlearn.runtime import quiet_optional_backends

    # on every process (rank 1 starts no hub), before the Trainer's import prints optional backends' notices
    quiet_optional_backends()
    from transformers import Trainer, TrainingArguments

    from hf_unlearn import load_model, load_tofu, load_tokenizer, tokenize_qa
    from hf_unlearn.data import QACollator
    from hf_unlearn.hub import UnlearningHubMixin, verify_on_hub
    from hf_unlearn.models import build_tiny_model
    from hf_unlearn.runtime import init_processes

    init_processes()  # every process prints "process R of N" (2 of them under cpu_2proc.yaml)

    class ToyGradientAscent(UnlearningHubMixin, Trainer):
        """Gradient ascent on the forget set: the smallest unlearning trainer that honours the card contract."""

        def __init__(self, *a, forget_ids=(), **kw):
            super().__init__(*a, **kw)
            self.forget_ids = list(forget_ids)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            inputs = dict(inputs)
            inputs.pop("id", None)
            outputs = model(**inputs)
            return (-outputs.loss, outputs) if return_outputs else -outputs.loss

        def unlearning_card_info(self):
            return {"method": "GradAscent", "hyperparameters": {"learning_rate": self.args.learning_rate,
                                                                "max_steps": self.args.max_steps},
                    "forget_ids": self.forget_ids, "citation": "", "paper": "",
                    "evaluation": {k: v for h in self.state.log_history for k, v in h.items() if k == "train_loss"}}

    tok = load_tokenizer(args.model or args.tokenizer)
    model = load_model(args.model) if args.model else build_tiny_model("llama", tok, hidden_size=32, num_layers=2,
                                                                       num_heads=2)
    forget = load_tofu("forget01", args.tofu).select(range(8))
    data = tokenize_qa(forget, tok, max_length=64)
    out = args.output_dir or tempfile.mkdtemp(prefix="hf_unlearn_publish_")
    training_args = TrainingArguments(output_dir=out, max_steps=args.steps, per_device_train_batch_size=4,
                                      learning_rate=1e-4, report_to=[], remove_unused_columns=False,
                                      save_strategy="no", logging_steps=1, use_cpu=True)
    trainer = ToyGradientAscent(model=model, args=training_args, train_dataset=data, processing_class=tok,
                                data_collator=QACollator.from_tokenizer(tok), forget_ids=forget["id"])
    trainer.train()
    result = trainer.push_to_hub(args.repo, deletion=True, datasets=["locuslab/TOFU"])
    if result is not None:
        print(f"published {result.repo_id} commit {result.commit} tag {result.tag}")
        print(f"  files: {', '.join(result.files)}")
        report = verify_on_hub(args.repo, result.tag, expect_root=result.state_dict_root, expect_commit=result.commit)
        print(report.summary())
    if server is not None:
        server.stop()


if __name__ == "__main__":
    main()
