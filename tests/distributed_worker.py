"""One process of the two-process check in ``test_distributed.py``: ``python
tests/distributed_worker.py OUT.json`` with ``JAX_NUM_CPU_DEVICES=2`` and, for a member
of the multi-process run, ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and
``JAX_PROCESS_ID`` (without them: the single-process reference, one device).

Greedy tokens through the engine (plain, a chain, a tree) of ``sharding_worker``'s small
random target and draft on each mesh of ``MESHES``, what the start-up line said, and the
error for a policy that decides from timings. Writes a JSON object to OUT.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from sharding_worker import CHAIN, ENGINE_BASE, MODES, decode, engine_inputs  # noqa: E402

from eagle_jax.runtime.sharding import initialize_distributed  # noqa: E402

# (data, model) over the 4 devices of two processes: model=4 splits every matrix across
# the processes; data=2 puts each process's devices on its own rows, so the tokens read
# back are gathered from both.
MESHES = [(1, 4), (2, 2)]


def main(out: Path) -> None:
    line = initialize_distributed()  # from the environment; None for the reference
    import jax

    from eagle_jax.serving.engine import Engine, EngineConfig
    from eagle_jax.errors import ConfigError

    target, draft, prompts, params = engine_inputs()
    result = {"distributed": line, "process": jax.process_index(), "processes": jax.process_count(),
              "devices": jax.device_count(), "local_devices": jax.local_device_count(), "runs": {}}
    for mesh in MESHES if line is not None else [(1, 1)]:
        for mode, shape in MODES:
            r = decode(target, draft, prompts, params, mesh, shape)
            r.pop("engine")
            result["runs"][f"{mesh[0]}x{mesh[1]} {mode}"] = r
    if line is not None:
        try:
            Engine(target, draft, EngineConfig(speculative=CHAIN, spec_policy="auto", spec_shapes=(CHAIN,),
                                               mesh=(1, 4), **ENGINE_BASE), progress=False)
            result["auto_error"] = None
        except ConfigError as e:
            result["auto_error"] = str(e)
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
