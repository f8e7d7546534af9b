"""Speculative decoding as pure step functions: shapes (config), lossless sampling and
verification (sampling), one compiled draft -> verify -> draft-extend step (steps), and a
measurement-only proposer with a fixed acceptance (oracle). No host state, no requests."""
