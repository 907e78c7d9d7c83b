"""Template `identification`: find the user by e-mail or by name and zip (at difficulty 2+ also the order by its
contents) before one write — family `identify_then_act`."""

from __future__ import annotations

from trace_core.synthesis.templates._base import FamilyTemplate


class Identification(FamilyTemplate):
    template = "identification"
    capability = "identification"
    family = "identify_then_act"
    keywords = ("identify", "identification", "authenticate", "account", "user", "lookup", "find", "email", "zip")
    max_scaffold = 0  # the first look-up is the identification itself: prefilled, nothing would be left to train
