"""Unlearning evaluation: TOFU, MUSE-News, multiple-choice tasks."""
