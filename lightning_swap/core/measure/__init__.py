"""Measure: one training step (observed, profiled or fake-run) becomes a frozen
:class:`~.model_profile.ModelProfile`, the contract with ``decide/``."""
