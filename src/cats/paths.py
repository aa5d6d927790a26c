"""Where CATS finds and keeps files: its cache folder and the default model and data in ``../shared``."""

from __future__ import annotations

import os
from pathlib import Path

HUB_DEFAULT = "HuggingFaceTB/SmolLM2-135M-Instruct"
SHARED_DEFAULT = Path("shared") / "data" / "smollm2-135m-instruct-gguf"
IMPORT_ROOT = Path(__file__).resolve().parents[1]  # the folder this package is imported from (a checkout's src/)
PROJECT_ROOT = IMPORT_ROOT.parent  # the checkout (src/cats/paths.py), for ../shared beside it


def cache_root() -> Path:
    """Where converted models and other derived files live: ``$CATS_CACHE`` or ``~/.cache/cats``."""
    return Path(os.environ.get("CATS_CACHE") or Path.home() / ".cache" / "cats")


def shared_path(relative: Path) -> Path | None:
    """``../shared/<relative>`` next to the working directory or the project, if it exists."""
    for base in (Path.cwd(), PROJECT_ROOT):
        candidate = base.parent / relative
        if candidate.exists():
            return candidate
    return None


def default_model() -> str:
    """SmolLM2-135M-Instruct: the copy in ``../shared/data`` (next to the project or the working directory)
    when there is one, else its Hub id."""
    candidate = shared_path(SHARED_DEFAULT)
    return str(candidate) if candidate is not None and candidate.is_dir() else HUB_DEFAULT
