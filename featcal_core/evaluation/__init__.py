"""Evaluation: classification heads (expert, linear, zero-shot), language-model
scoring by label continuation."""
