"""Approximate unlearning trainers."""
