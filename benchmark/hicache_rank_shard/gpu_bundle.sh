#!/usr/bin/env bash
# Prepare .gpu/ (ignored; copied to the GPU host with the working tree): the
# patched cp312 wheel and sglang's small runtime deps missing from the GPU image.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .gpu/whl .gpu/dist
SGL_BUILD_DIR=build/cp312 SGL_CACHE_DIR=build/cache SGL_UPSTREAM_DIR=build/upstream \
  PYTHON_TAG=cp312 python3 scripts/series.py apply
rm -f .gpu/dist/*.whl
SGL_BUILD_DIR=build/cp312 SGL_DIST_DIR=.gpu/dist build/tools/bin/python scripts/build_wheel.py
plats=""
for p in manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
  plats="$plats --platform ${p}_x86_64"
done
for pkg in orjson==3.13.0 pybase64==1.5.1 msgspec==0.23.0 pydantic==2.14.4 pydantic_core==2.50.5 \
  annotated-types==0.8.0 typing-inspection==0.4.5 pyzmq==27.3.0 ipython==9.18.1 traitlets==5.16.1 \
  jedi==0.20.1 parso==0.8.7 matplotlib-inline==0.2.2 pexpect==4.9.0 ptyprocess==0.7.0 \
  prompt_toolkit==3.0.53 wcwidth==0.9.4 stack_data==0.6.3 asttokens==3.0.2 executing==2.3.0 \
  pure_eval==0.2.4 ipython_pygments_lexers==1.1.1 decorator dill==0.4.1 apache-tvm-ffi==0.1.11 \
  compressed-tensors==0.18.0 gguf==0.19.0 setproctitle==1.3.8 openai==2.8.0 distro jiter==0.19.0 \
  sniffio==1.3.1 partial-json-parser==0.2.1.1.post7 uvicorn==0.54.0 fastapi==0.165.0 \
  starlette==1.10.0 loguru==0.7.3 annotated-doc==0.0.7; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp $plats -d .gpu/whl "$pkg"
done
# What the runs' JSON records as their revision and series label (no .git there).
python3 - <<'PY'
import json
from benchmark.bench_meta import git_revision, series_label
open(".gpu/revision.json", "w").write(
    json.dumps({"git_revision": git_revision(), "series_label": series_label()})
)
PY
du -sh .gpu
