"""The host side: the engine's configuration (config), requests and the one result type
(requests), speculation policies (policy), the scheduler (which request is in which row),
the executor (the device state and the compiled graphs), metrics, and the Engine facade
that runs them as one host loop (engine); offline generation (generate) and prompt files
(prompts). Imports every layer below (runtime, spec, models, checkpoint)."""
