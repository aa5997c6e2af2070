"""vla: cross-embodiment vision-language-action robot foundation models in PyTorch."""

__version__ = "0.1.0"
