"""The unlearning metrics that fit ``evaluate``'s (predictions, references) shape, loadable the ``evaluate`` way.

```python
import evaluate
from hf_unlearn.eval.hf_metrics import UNLEARNING_METRIC_PATH
rouge = evaluate.load(UNLEARNING_METRIC_PATH, "rouge_l")      # predictions: generations, references: answers
rouge.compute(predictions=["the cat on the mat"], references=["the cat sat on the mat"])
auc = evaluate.load(UNLEARNING_METRIC_PATH, "mia_auc")        # predictions: non-membership scores (e.g. losses),
auc.compute(predictions=[0.1, 0.2, 0.9], references=[1, 1, 0])  # references: 1 = member (forget), 0 = holdout
```
Thin wrappers over :mod:`hf_unlearn.eval.metrics` (the definitions and tests live there).
"""

import datasets
import evaluate

from hf_unlearn.eval import metrics as M

_DESCRIPTION = "TOFU/MUSE unlearning metrics: ROUGE-L recall/F1 of generations, membership-inference AUC."
_CITATION = """@article{maini2024tofu, title={TOFU: A Task of Fictitious Unlearning for LLMs},
author={Maini, Pratyush and Feng, Zhili and Schwarzschild, Avi and Lipton, Zachary C. and Kolter, J. Zico},
journal={arXiv preprint arXiv:2401.06121}, year={2024}}"""
_INPUTS = """rouge_l: predictions (generated strings), references (ground-truth strings) -> mean recall and F1.
mia_auc: predictions (non-membership scores, higher = looks unseen), references (1 = member, 0 = non-member) -> AUC."""

_FEATURES = {
    "rouge_l": datasets.Features({"predictions": datasets.Value("string"), "references": datasets.Value("string")}),
    "mia_auc": datasets.Features({"predictions": datasets.Value("float64"), "references": datasets.Value("int64")}),
}


class Unlearning(evaluate.Metric):
    def _info(self):
        if self.config_name not in _FEATURES:
            raise KeyError(f"unknown unlearning metric {self.config_name!r}; choose one of {', '.join(_FEATURES)}")
        return evaluate.MetricInfo(description=_DESCRIPTION, citation=_CITATION, inputs_description=_INPUTS,
                                   features=_FEATURES[self.config_name])

    def _compute(self, predictions, references):
        if self.config_name == "rouge_l":
            scores = [M.rouge_l(p, r) for p, r in zip(predictions, references)]
            return {"rouge_l_recall": M.nanmean([s[0] for s in scores]), "rouge_l_f1": M.nanmean([s[2] for s in scores])}
        members = [p for p, r in zip(predictions, references) if r == 1]
        nonmembers = [p for p, r in zip(predictions, references) if r == 0]
        return {"auc": M.mia_auc(members, nonmembers)}
