"""Run-dir, logging, checkpoint and optimizer-building helpers for train.py / evaluate.py."""
