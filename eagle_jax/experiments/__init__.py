"""Measurement commands on top of the engine: bench, ablate and eval-draft. They import
``serving`` and below, and never each other's command modules."""
