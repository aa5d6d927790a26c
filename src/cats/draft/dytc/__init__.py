"""DyTC: a scheduler that picks, every step, which drafter to run and how much of its draft to verify, from
measured acceptance (`hindsight`) and a measured verification cost (`cost`)."""

from cats.draft.dytc.build import make_dytc
from cats.draft.dytc.scheduler import DyTCDrafter

__all__ = ["DyTCDrafter", "make_dytc"]
