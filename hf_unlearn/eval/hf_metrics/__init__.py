"""``evaluate``-loadable wrappers: ``evaluate.load(UNLEARNING_METRIC_PATH, "rouge_l" | "mia_auc")``."""

from pathlib import Path

UNLEARNING_METRIC_PATH = str(Path(__file__).parent / "unlearning" / "unlearning.py")
