"""Multiple-choice tasks for causal LMs: prompt format, per-choice scoring, accuracy.

A row (``shared/data/tasks`` schema: ``id, context, question, choices, label``) becomes one prompt that lists the
choices and ends with ``Answer:``; each choice is scored by the log-likelihood of `` {choice}`` after the prompt,
averaged over its tokens (length-normalised, so long choices are not penalised). The prediction is the best-scoring
choice. Listing the choices in the prompt means the last prompt token "knows" the options, which is what the
representation analyses (variance, linear probes) read.

The same encoding (:class:`MultipleChoiceCollator`) drives training (:mod:`hf_unlearn.methods.random_label`) and
evaluation (:func:`evaluate_multiple_choice`), so train and test see identical inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from ..errors import UnlearnError

ANSWER_PREFIX = "Answer:"


def format_mc_prompt(row: dict, list_choices: bool = True) -> str:
    """The prompt for one row: optional context, the question, the lettered choices, then ``Answer:``."""
    parts = []
    if row.get("context"):
        parts.append(f"Context: {row['context'].strip()}")
    parts.append(f"Question: {str(row['question']).strip()}")
    if list_choices:
        parts.append("Choices:\n" + "\n".join(f"- {str(c).strip()}" for c in row["choices"]))
    parts.append(ANSWER_PREFIX)
    return "\n".join(parts)


def validate_mc_row(row: dict, where: str = "dataset") -> None:
    """At least two choices and an integer label inside them (a clear error instead of a silent wrong score)."""
    rid = row.get("id", "?")
    choices = row.get("choices")
    if not isinstance(choices, (list, tuple)) or len(choices) < 2:
        n = len(choices) if isinstance(choices, (list, tuple)) else 0
        raise UnlearnError(f"{where} row {rid!r} has {n} choice(s); multiple choice needs at least 2")
    label = row.get("label")
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(choices):
        raise UnlearnError(f"{where} row {rid!r} has label {label!r} outside its {len(choices)} choices")


def check_split(dataset, where: str) -> None:
    """Refuse an empty split and malformed rows before any model work."""
    if dataset is None or len(dataset) == 0:
        raise UnlearnError(f"{where} is empty; multiple-choice training and evaluation need at least one row")
    for row in dataset:
        validate_mc_row(row, where)


def encode_mc_row(row: dict, tokenizer, max_length: int, list_choices: bool = True) -> list[tuple[list[int], int]]:
    """Token ids of ``prompt + " " + choice`` for every choice, with the prompt length in tokens.

    The prompt is cut from the left when a sequence would exceed ``max_length`` (the end of the prompt, the
    choices and ``Answer:`` matter most); choices longer than half of ``max_length`` are cut from the right.
    """
    prompt = tokenizer(format_mc_prompt(row, list_choices), add_special_tokens=False)["input_ids"]
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    out = []
    for choice in row["choices"]:
        answer = tokenizer(" " + str(choice).strip(), add_special_tokens=False)["input_ids"][: max(1, max_length // 2)]
        if not answer:
            answer = [tokenizer.eos_token_id]
        room = max_length - len(answer) - len(bos)
        if room < 1:
            raise UnlearnError(f"max_length={max_length} leaves no room for the prompt; raise it")
        p = bos + prompt[-room:]
        out.append((p + answer, len(p)))
    return out


@dataclass
class MultipleChoiceCollator:
    """Turn raw task rows into one flat batch of (prompt + choice) sequences.

    Output keys: ``input_ids``, ``attention_mask`` (right padded), ``target_mask`` (1 on choice tokens),
    ``example_index`` / ``choice_slot`` (where each sequence belongs in the ``[batch, max_choices]`` score grid),
    ``prompt_last`` (index of the last prompt token of each sequence), ``mc_labels`` (``[batch]``), ``row_ids``
    (the rows' ids, a list) and, when the rows carry one, ``mc_true_labels`` (the ``true_label`` column kept by
    random-label training, so training can log per-example correctness under the true labels).
    """

    tokenizer: Any
    max_length: int = 256
    list_choices: bool = True
    label_column: str = "label"

    def __call__(self, rows: list[dict]) -> dict[str, Any]:
        import torch

        if not rows:
            raise UnlearnError("cannot collate an empty batch")
        pad = self.tokenizer.pad_token_id
        if pad is None:
            raise UnlearnError("the tokenizer has no pad token; load it with hf_unlearn.load_tokenizer")
        seqs, lengths, ex_idx, slots, labels = [], [], [], [], []
        for i, row in enumerate(rows):
            row = {**row, "label": row[self.label_column]}
            validate_mc_row(row, "batch")
            labels.append(row["label"])
            for j, (ids, n_prompt) in enumerate(encode_mc_row(row, self.tokenizer, self.max_length, self.list_choices)):
                seqs.append(ids)
                lengths.append(n_prompt)
                ex_idx.append(i)
                slots.append(j)
        width = max(len(s) for s in seqs)
        input_ids = torch.full((len(seqs), width), pad, dtype=torch.long)
        attention = torch.zeros((len(seqs), width), dtype=torch.long)
        target = torch.zeros((len(seqs), width), dtype=torch.long)
        for k, (s, n) in enumerate(zip(seqs, lengths)):
            input_ids[k, : len(s)] = torch.tensor(s)
            attention[k, : len(s)] = 1
            target[k, n: len(s)] = 1
        batch = {
            "input_ids": input_ids,
            "attention_mask": attention,
            "target_mask": target,
            "example_index": torch.tensor(ex_idx),
            "choice_slot": torch.tensor(slots),
            "prompt_last": torch.tensor(lengths) - 1,
            "mc_labels": torch.tensor(labels),
            "row_ids": [row.get("id", i) for i, row in enumerate(rows)],
        }
        if "true_label" in rows[0]:
            batch["mc_true_labels"] = torch.tensor([int(r["true_label"]) for r in rows])
        return batch


def sequence_logprob(logits, input_ids, target_mask, normalize: bool = True):
    """Sum (or mean, when ``normalize``) of log p(token) over the tokens where ``target_mask`` is 1.

    ``logits[:, t]`` predicts ``input_ids[:, t + 1]``, so the mask is shifted by one. Shape ``[n_sequences]``.
    """
    import torch

    mask = target_mask[:, 1:].bool()
    rows, cols = torch.nonzero(mask, as_tuple=True)
    # log-softmax only where a choice token is predicted: the full [seq, vocab] table is most of the cost
    logp = torch.log_softmax(logits[:, :-1][rows, cols].float(), dim=-1)
    tok = logp.gather(-1, input_ids[:, 1:][rows, cols].unsqueeze(-1)).squeeze(-1)
    total = torch.zeros(logits.shape[0], dtype=tok.dtype, device=tok.device).index_add(0, rows, tok)
    return total / mask.sum(-1).clamp(min=1) if normalize else total


def choice_score_grid(seq_scores, example_index, choice_slot, n_examples: int):
    """Scatter per-sequence scores into ``[n_examples, max_choices]``; missing choices are ``-inf``."""
    import torch

    width = int(choice_slot.max()) + 1
    grid = torch.full((n_examples, width), float("-inf"), dtype=seq_scores.dtype, device=seq_scores.device)
    grid[example_index, choice_slot] = seq_scores
    return grid


def multiple_choice_loss(scores, labels):
    """Cross-entropy over the choice scores (``-inf`` = no such choice): train the model to pick ``labels``."""
    import torch

    return torch.nn.functional.cross_entropy(scores, labels)


def choice_probabilities(scores):
    """Softmax over each row's available choices (``-inf`` entries get 0)."""
    import torch

    return torch.softmax(torch.as_tensor(scores, dtype=torch.float64), dim=-1)


def accuracy(predictions: Sequence[int], labels: Sequence[int]) -> float:
    """Fraction of predictions equal to the labels."""
    if len(predictions) != len(labels):
        raise UnlearnError(f"{len(predictions)} predictions for {len(labels)} labels")
    if not len(labels):
        raise UnlearnError("accuracy of an empty set is undefined")
    return sum(int(p) == int(y) for p, y in zip(predictions, labels)) / len(labels)


def chance_accuracy(n_choices: Sequence[int]) -> float:
    """Expected accuracy of uniform guessing: the mean of 1/n_choices over the rows."""
    if not len(n_choices):
        raise UnlearnError("chance accuracy of an empty set is undefined")
    if any(int(n) < 2 for n in n_choices):
        raise UnlearnError("every row needs at least 2 choices")
    return sum(1.0 / int(n) for n in n_choices) / len(n_choices)


def forward_scores(model, batch: dict, normalize: bool = True, output_hidden_states: bool = False):
    """Run the model on a collated batch; returns ``(scores [batch, max_choices], outputs)``."""
    outputs = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=output_hidden_states
    )
    seq = sequence_logprob(outputs.logits, batch["input_ids"], batch["target_mask"], normalize)
    grid = choice_score_grid(seq, batch["example_index"], batch["choice_slot"], len(batch["mc_labels"]))
    return grid, outputs


@dataclass
class MCResult:
    """Per-example results of scoring a multiple-choice set."""

    ids: list
    labels: list[int]
    predictions: list[int]
    n_choices: list[int]
    true_prob: list[float]  # softmax probability of the true label over the choices ("confidence")
    hidden_states: Any = None  # numpy [n_layers + 1, n_examples, hidden] at the last prompt token, if requested
    extra: dict = field(default_factory=dict)

    @property
    def correct(self) -> list[bool]:
        return [p == y for p, y in zip(self.predictions, self.labels)]

    @property
    def accuracy(self) -> float:
        return accuracy(self.predictions, self.labels)

    @property
    def chance(self) -> float:
        return chance_accuracy(self.n_choices)

    @property
    def mean_confidence(self) -> float:
        return sum(self.true_prob) / len(self.true_prob)


def evaluate_multiple_choice(
    model,
    tokenizer,
    dataset,
    *,
    batch_size: int = 8,
    max_length: int = 256,
    normalize: bool = True,
    list_choices: bool = True,
    hidden_states: bool = False,
    label_column: str = "label",
) -> MCResult:
    """Score every row of ``dataset`` (task schema) and return predictions, accuracy and confidences.

    With ``hidden_states=True`` also returns every layer's hidden state at the last prompt token (the
    "last question token" representation used by the variance predictor and the probes).
    """
    import numpy as np
    import torch

    check_split(dataset, "evaluation set")
    collator = MultipleChoiceCollator(tokenizer, max_length=max_length, list_choices=list_choices,
                                      label_column=label_column)
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    preds, probs, n_choices, states = [], [], [], []
    rows = list(dataset)
    try:
        with torch.no_grad():
            for start in range(0, len(rows), batch_size):
                chunk = rows[start: start + batch_size]
                batch = {k: v.to(device) if hasattr(v, "to") else v for k, v in collator(chunk).items()}
                grid, out = forward_scores(model, batch, normalize, output_hidden_states=hidden_states)
                p = choice_probabilities(grid.cpu())
                preds.extend(grid.argmax(-1).tolist())
                probs.extend(p[torch.arange(len(chunk)), batch["mc_labels"].cpu()].tolist())
                n_choices.extend(len(r["choices"]) for r in chunk)
                if hidden_states:
                    first = batch["choice_slot"] == 0  # the prompt is shared: read it from each row's first choice
                    pos = batch["prompt_last"][first]
                    rows_idx = torch.nonzero(first).squeeze(-1)
                    states.append(torch.stack([h[rows_idx, pos] for h in out.hidden_states]).float().cpu().numpy())
    finally:
        model.train(was_training)
    return MCResult(
        ids=[r.get("id") for r in rows],
        labels=[int(r[label_column]) for r in rows],
        predictions=preds,
        n_choices=n_choices,
        true_prob=probs,
        hidden_states=np.concatenate(states, axis=1) if hidden_states else None,
    )
