"""Measurement commands on top of the engine: bench, ablate and eval-draft."""
