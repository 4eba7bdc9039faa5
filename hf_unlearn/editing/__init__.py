"""Closed-form weight edits."""
