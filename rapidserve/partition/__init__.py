"""Adaptive resource manager: measured profiles and the pure decode/prefill partition decision."""
