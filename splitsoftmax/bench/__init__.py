"""Benchmarks against the peers (``python -m splitsoftmax bench <name>``)."""
