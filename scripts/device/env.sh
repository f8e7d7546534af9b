# Sourced by the device scripts (check.sh, draft_pipeline.sh): run the package from this
# checkout (no install: the GPU machine has no registry) with that machine's JAX; wheels a
# machine lacks travel in .whl/ and are installed into /tmp/eagle_jax_site first.
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
: "${OUT:?set OUT to the folder the results go to}"
PY=${PYTHON:-python3}
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/eagle_jax_site .whl/*.whl \
    || { echo "installing .whl/ failed" >&2; exit 1; }
  export PYTHONPATH="/tmp/eagle_jax_site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
