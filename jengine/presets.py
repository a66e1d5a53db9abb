"""Built-in model presets: named configs shipped in `configs/models/` (no weights; random init)."""

from __future__ import annotations

import os
from importlib import resources

DEFAULT_MODEL = "jengine/tiny-llama"
_PREFIX = "jengine/"


def preset_names() -> list[str]:
    root = resources.files("jengine.configs") / "models"
    return sorted(_PREFIX + p.name for p in root.iterdir() if p.is_dir())


def resolve_model(model: str) -> tuple[str, bool]:
    """A model argument to `(directory, is_preset)`; presets are named `jengine/<name>`."""
    if not isinstance(model, str) or not model:
        raise ValueError(f"model must be a directory path or a preset name, got {model!r}")
    if os.path.isdir(model):
        return model, False
    if model.startswith(_PREFIX):
        path = resources.files("jengine.configs") / "models" / model.removeprefix(_PREFIX)
        if path.is_dir():
            return str(path), True
    raise ValueError(
        f"model {model!r} is neither a local directory nor a built-in preset "
        f"(presets: {', '.join(preset_names())}); jengine cannot download from a model hub"
    )
