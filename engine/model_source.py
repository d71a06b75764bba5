"""Where an engine's model comes from: the built-in tiny model (built offline on first use) or a path."""

from __future__ import annotations

from pathlib import Path

BUILTIN_PREFIX = "builtin:"


def resolve_model_dir(source: str) -> Path:
    if source.startswith(BUILTIN_PREFIX):
        name = source[len(BUILTIN_PREFIX) :]
        from engine.tiny_model import TINY_MODEL_NAME, ensure_tiny_model

        if name != TINY_MODEL_NAME:
            raise ValueError(f"unknown built-in model {name!r} (built-in: {TINY_MODEL_NAME!r})")
        return ensure_tiny_model()
    path = Path(source).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model directory {path} has no config.json")
    return path
