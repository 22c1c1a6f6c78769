"""Serving-framework integrations of arfuse: arfuse.integrations.sglang."""
