"""Exact deletion by trace-preserving replay."""
