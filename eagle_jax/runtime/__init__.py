"""Placing and compiling: device meshes and sharding rules (sharding) and the step table
that compiles every graph the engine can run at start-up (step_table). Imports ``spec``
and the layers below it; knows nothing of requests."""
