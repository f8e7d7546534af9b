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

from sharding_worker import CHAIN, NEW_TOKENS, TREE, tiny_target  # noqa: E402

from eagle_jax.sharding import initialize_distributed  # noqa: E402

# (data, model) over the 4 devices of two processes: model=4 splits every matrix across
# the processes; data=2 puts each process's devices on its own rows, so the tokens read
# back are gathered from both.
MESHES = [(1, 4), (2, 2)]


def main(out: Path) -> None:
    line = initialize_distributed()  # from the environment; None for the reference
    import jax
    import numpy as np

    from eagle_jax.checkpoint.draft_io import random_draft
    from eagle_jax.engine import Engine, EngineConfig
    from eagle_jax.errors import ConfigError
    from eagle_jax.policy import FixedPolicy
    from eagle_jax.sampling import SamplingParams

    target = tiny_target()
    draft = random_draft(target.config, seed=1, draft_vocab_size=64)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, size=n).tolist() for n in (3, 5, 7, 9, 11, 13, 14, 6)]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    base = dict(max_batch=8, batch_buckets=(8,), max_seq_len=32, prompt_buckets=(16,), sampled_steps=False)
    result = {"distributed": line, "process": jax.process_index(), "processes": jax.process_count(),
              "devices": jax.device_count(), "local_devices": jax.local_device_count(), "runs": {}}
    for mesh in MESHES if line is not None else [(1, 1)]:
        for mode, shape in (("plain", None), ("chain", CHAIN), ("tree", TREE)):
            cfg = EngineConfig(speculative=shape, mesh=mesh, **base)
            engine = Engine(target, None if shape is None else draft, cfg,
                            policy=None if shape is None else FixedPolicy(shape), progress=False)
            done = engine.generate(prompts, params)
            result["runs"][f"{mesh[0]}x{mesh[1]} {mode}"] = {
                "tokens": [c.token_ids for c in done], "accept_lengths": [c.accept_lengths for c in done],
                "describe": engine._describe,
            }
    if line is not None:
        try:
            Engine(target, draft, EngineConfig(speculative=CHAIN, spec_policy="auto", spec_shapes=(CHAIN,),
                                               mesh=(1, 4), **base), progress=False)
            result["auto_error"] = None
        except ConfigError as e:
            result["auto_error"] = str(e)
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
