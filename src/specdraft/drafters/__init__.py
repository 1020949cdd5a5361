"""Drafters: every method that proposes candidates implements ``Drafter``."""

from .autoregressive import NoDrafter
from .base import DraftContext, Drafter, Proposal
from .lookup import LookupDrafter

__all__ = ["Drafter", "DraftContext", "Proposal", "NoDrafter", "LookupDrafter"]
