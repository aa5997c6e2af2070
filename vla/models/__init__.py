"""Models: VLM backbone + action expert + per-embodiment heads."""
