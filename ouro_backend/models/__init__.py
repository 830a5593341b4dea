"""Checkpoints shipped with the package. `ouro-demo` is the default model (docs/demo-model.md): a small
Ouro trained here on public-domain English, loaded through the same HF-directory path as a real one."""

from __future__ import annotations

from pathlib import Path

DEMO_MODEL = Path(__file__).resolve().parent / "ouro-demo"


def default_model() -> str:
    """The checkpoint used when no model is configured."""
    if not (DEMO_MODEL / "config.json").is_file():
        raise FileNotFoundError(
            f"the demo model is missing from this installation ({DEMO_MODEL}); "
            f"pass a checkpoint directory (--model / model=) instead"
        )
    return str(DEMO_MODEL)
