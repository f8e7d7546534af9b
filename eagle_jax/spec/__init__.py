"""Speculative decoding as pure step functions: shapes (config), lossless sampling and
verification (sampling), one compiled draft -> verify -> draft-extend step (steps), a
measurement-only proposer with a fixed acceptance (oracle) and a one-request reference
loop to start reading from (reference). No host state, no requests; imports ``models``,
``kernels`` and the base modules."""
