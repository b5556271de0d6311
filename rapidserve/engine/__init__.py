"""The two-process RAPID engine: launcher, client API, decode and prefill workers."""
