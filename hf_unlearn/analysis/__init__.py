"""Diagnostics before and after unlearning."""
