"""Accuracy against compute: evaluation, the lmms-eval model, the router audit, the frontier."""
