#!/usr/bin/env bash
# The GPU path in one command, on a lent GPU machine: install what it lacks, run the CUDA tests
# (`pytest -m cuda`) and benchmarks/bench_gpu.py, and leave the log and the JSON in one folder.
#
#   benchmarks/gpu_check.sh --fetch   # where pip reaches its registry: wheels for the GPU box into .whl/
#   benchmarks/gpu_check.sh           # on the GPU box: about 6 minutes on one H100
#
# The GPU box is assumed to have python3 with a CUDA torch (and pytest) but none of the swarm's
# packages, and may reach no registry: the packages come from the wheels in .whl/ (git-ignored;
# carry the folder with the working tree), and only when something still fails to import from
# pip's registry. Results: $OUT if set, else benchmarks/results/gpu_check-<UTC time>/
# (gpu_check.log, bench_gpu.json, pytest_cuda.xml). PYTHON picks the interpreter (default
# python3); PYTHON_VERSION the GPU box's, for --fetch (default 3.12).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# What crowdtrain needs beyond torch: its own dependencies, the volunteer's (the two-volunteer test
# streams shards through `datasets`) and the coordinator's web extras, from pyproject.toml; not plotly (memcalc's
# page) nor psycopg (PostgreSQL coordinators), which the check does not use.
requirements() {
    "$PY" -c '
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
for req in project["dependencies"] + extras["volunteer"] + extras["web"]:
    if not req.startswith(("torch", "plotly", "psycopg")):
        print(req)
'
}

# Of those and what they need, what the device image lacks (its package list, 2026-11; numpy
# because the image's is 2.5 and the swarm extra pins < 2.4; protobuf at the version hivemind's
# messages were tested with). --fetch takes the versions installed where it runs, one wheel each
# without dependencies: about 60 MB once bitsandbytes is cut to one CUDA major, which with the
# tree (about 7 MB) fits the 64 MiB the device tool carries in one call.
LACKS=(numpy hivemind bitsandbytes datasets dill multiprocess annotated-types base58 blake3 cffi configargparse cryptography fastapi
       grpcio-tools mmh3 morphys netaddr opentelemetry-api prefetch-generator py-cid py-multibase
       protobuf py-multicodec py-multihash pycparser pydantic pydantic-core python-baseconv sqlalchemy starlette
       swagger-ui-py typing-inspection uvicorn varint)

if [[ "${1:-}" == "--fetch" ]]; then
    mkdir -p .whl
    platforms=()
    for n in 17 24 27 28 31 34; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
    platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
    pins=$("$PY" -c 'import sys, importlib.metadata as m; print(" ".join(f"{n}=={m.version(n)}" for n in sys.argv[1:]))' \
        "${LACKS[@]}") || exit 1
    for pin in $pins; do
        # A package published only as source (prefetch-generator, morphys, ...) is pure Python:
        # build its wheel here, where pip works; its py3-none-any wheel installs anywhere.
        "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "${PYTHON_VERSION:-3.12}" \
            --implementation cp "${platforms[@]}" -d .whl "$pin" 2>/dev/null \
            || "$PY" -m pip wheel -q --no-deps -w .whl "$pin" || { echo "!! no wheel for $pin"; exit 1; }
    done
    # bitsandbytes ships a kernel library for every CUDA, ROCm and XPU release (over 40 MB):
    # keep those for the device's CUDA major (CUDA_MAJOR, default 13: the image's torch is cu130)
    # and the CPU one, so the wheels and the tree fit one call of the device tool.
    "$PY" - "${CUDA_MAJOR:-13}" .whl/bitsandbytes-*.whl <<'PYEOF' || exit 1
import re, sys, zipfile, os
major, path = sys.argv[1], sys.argv[2]
keep = re.compile(rf"libbitsandbytes_(cpu|cuda{major}\d)\.so$")
dropped = lambda name: "libbitsandbytes_" in name and not keep.search(name)
slim = path + ".slim"
with zipfile.ZipFile(path) as src, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as dst:
    for item in src.infolist():
        if dropped(item.filename):
            continue
        data = src.read(item)
        if item.filename.endswith(".dist-info/RECORD"):
            data = b"".join(line for line in data.splitlines(keepends=True)
                            if not dropped(line.split(b",")[0].decode()))
        dst.writestr(item, data)
os.replace(slim, path)
PYEOF
    echo "wheels in .whl/: $(du -sh .whl | cut -f1) (the device tool carries at most 64 MiB with the tree)"
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

imports_ok() { "$PY" -c "import hivemind, bitsandbytes, datasets, fastapi, uvicorn, sqlalchemy, einops" 2>/dev/null; }
if ls .whl/*.whl >/dev/null 2>&1; then
    echo "== packages: installing the wheels in .whl/"
    "$PY" -m pip install -q --no-index --no-deps .whl/*.whl || echo "!! some wheels in .whl/ did not install"
fi
if imports_ok; then
    echo "== packages: all there"
else
    "$PY" -c "import hivemind, bitsandbytes, datasets, fastapi, uvicorn, sqlalchemy, einops" 2>&1 | tail -1
    echo "== packages: from pip's registry"
    mapfile -t reqs < <(requirements)
    "$PY" -m pip install -q "${reqs[@]}" || echo "!! pip could not install everything; the tests below say what is missing"
fi

status=0
echo "== CUDA tests (pytest -m cuda)"
timeout 270 "$PY" -m pytest -m cuda -q -p no:cacheprovider --junitxml="$OUT/pytest_cuda.xml" tests/test_cuda.py \
    || status=1
echo "== bench_gpu.py"
timeout 240 "$PY" benchmarks/bench_gpu.py --steps 3 --warmup 1 --out "$OUT/bench_gpu.json" || status=1
echo "== done (status $status): $OUT"
exit $status
