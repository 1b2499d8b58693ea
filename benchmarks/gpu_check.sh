#!/usr/bin/env bash
# The GPU path in one command, on a lent GPU machine: install what it lacks, run the CUDA tests
# (`pytest -m cuda`) and benchmarks/bench_gpu.py, and leave the log and the JSON in one folder.
#
#   benchmarks/gpu_check.sh --fetch   # where pip reaches its registry: wheels for the GPU box into .whl/
#   benchmarks/gpu_check.sh           # on the GPU box: about 7 minutes on one H100
#
# The GPU box is assumed to have python3 with a CUDA torch (and pytest) but none of the swarm's
# packages, and may reach no registry: the packages come from the wheels in .whl/ (git-ignored;
# carry the folder with the working tree), and only when those fail from pip's registry.
# Results: $OUT if set, else benchmarks/results/gpu_check-<UTC time>/ (gpu_check.log,
# bench_gpu.json, pytest_cuda.xml). PYTHON picks the interpreter (default python3);
# PYTHON_VERSION the GPU box's, for --fetch (default 3.12).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# What crowdtrain needs beyond torch: its own dependencies, the swarm and the coordinator's web
# extras (the two-volunteer test starts a coordinator), from pyproject.toml.
requirements() {
    "$PY" - <<'EOF'
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
for req in project["dependencies"] + extras["swarm"] + extras["web"]:
    if not req.startswith("torch"):
        print(req)
EOF
}

if [[ "${1:-}" == "--fetch" ]]; then
    # Binary wheels for the GPU box's Python (manylinux x86_64), with their dependencies; torch
    # and the CUDA libraries are already there, so whatever pulls them in is fetched without deps.
    mkdir -p .whl
    platforms=()
    for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
               manylinux1_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_24_x86_64; do
        platforms+=(--platform "$tag")
    done
    ver=${PYTHON_VERSION:-3.12}
    fetch=(-m pip download --only-binary=:all: --python-version "$ver" --implementation cp
           "${platforms[@]}" -d .whl)
    mapfile -t reqs < <(requirements)
    others=()
    for req in "${reqs[@]}"; do [[ "$req" == bitsandbytes* ]] || others+=("$req"); done
    "$PY" "${fetch[@]}" "${others[@]}" || exit 1
    "$PY" "${fetch[@]}" --no-deps "$(printf '%s\n' "${reqs[@]}" | grep '^bitsandbytes')" || exit 1
    echo "wheels in .whl/ ($(du -sh .whl | cut -f1)); the device tool carries at most 64 MiB in all"
    exit 0
fi

OUT=${OUT:-benchmarks/results/gpu_check-$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
exec > >(tee -a "$LOG") 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
echo "== gpu_check $(date -u +%FT%TZ) on $(hostname), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "nvidia-smi: none"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'sees', torch.cuda.device_count(), 'GPU(s)')"

mapfile -t reqs < <(requirements)
if "$PY" -c "import hivemind, bitsandbytes, fastapi" 2>/dev/null; then
    echo "== packages: already installed"
elif ls .whl/*.whl >/dev/null 2>&1 && "$PY" -m pip install -q --no-index --find-links .whl "${reqs[@]}"; then
    echo "== packages: installed from .whl/"
else
    echo "== packages: from pip's registry"
    "$PY" -m pip install -q "${reqs[@]}" || echo "!! pip could not install everything; the tests below say what is missing"
fi

status=0
echo "== CUDA tests (pytest -m cuda)"
timeout 300 "$PY" -m pytest -m cuda -q -p no:cacheprovider --junitxml="$OUT/pytest_cuda.xml" tests/test_cuda.py \
    || status=1
echo "== bench_gpu.py"
timeout 180 "$PY" benchmarks/bench_gpu.py --out "$OUT/bench_gpu.json" || status=1
echo "== done (status $status): $OUT"
exit $status
