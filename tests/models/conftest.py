"""Fixtures: small random Hugging Face checkpoints of each supported architecture."""

import pytest

from hf_factories import ARCHS, make_hf_model


@pytest.fixture(scope="session", params=list(ARCHS))
def hf_checkpoint(request, tmp_path_factory):
    """(kind, transformers model, directory it was saved to)."""
    model = make_hf_model(request.param)
    out = tmp_path_factory.mktemp(f"hf_{request.param}")
    model.save_pretrained(out, safe_serialization=True)
    return request.param, model, out
