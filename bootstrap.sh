#!/usr/bin/env bash
# One command from a fresh clone: set up .venv (Python 3.11; torch 2.13.0 CPU first, then ckptd and its
# pinned dependencies from .ci/constraints.txt), then run what was asked:
#   ./bootstrap.sh demo [ckptd demo flags]     the main job: daemon + 4 Megatron ranks, save, reload
#   ./bootstrap.sh test [pytest args]          the test suite (what CI runs), three tests at a time
#   ./bootstrap.sh bench [benchmarks/run.py flags]
#   ./bootstrap.sh setup                       only set up
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3.11}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.ckptd-installed
want=$(cat pyproject.toml .ci/constraints.txt | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "bootstrap: installing into .venv (torch 2.13.0 CPU first, then ckptd[all,test,verl,bench])" >&2
  # the CPU build: from the machine's wheels where pip is configured with them (find-links), or from
  # CKPTD_TORCH_INDEX (e.g. https://download.pytorch.org/whl/cpu); PyPI's Linux wheel is the CUDA build
  .venv/bin/pip install --quiet --disable-pip-version-check \
    ${CKPTD_TORCH_INDEX:+--index-url "$CKPTD_TORCH_INDEX"} torch==2.13.0
  .venv/bin/python -W ignore -c 'import torch; torch.version.cuda is None or print(
      f"bootstrap: note: torch {torch.__version__} is a CUDA build (CKPTD_TORCH_INDEX picks the CPU one)")' >&2
  .venv/bin/pip install --quiet --disable-pip-version-check -c .ci/constraints.txt -e ".[all,test,verl,bench]"
  echo "$want" > "$stamp"
fi
what=${1:-setup}
# s3rver (npm), the second S3 implementation the S3 tests run against: for the tests only (the demo and the
# benchmarks do not need it); skipped where npm is missing, a warning where it cannot be installed (the S3
# tests then say what is missing: they fail under CI=true, as .ci/run sets it, and skip elsewhere)
S3RVER_VERSION=3.7.1  # keep in step with ckptd/testing/s3rver.py
if [ "$what" = test ] || [ "$what" = setup ]; then
  if command -v npm >/dev/null && [ ! -x .ci/node_modules/.bin/s3rver ]; then
    echo "bootstrap: installing s3rver@$S3RVER_VERSION into .ci/node_modules" >&2
    npm install --prefix .ci --no-save --no-package-lock --no-audit --no-fund --silent "s3rver@$S3RVER_VERSION" >&2 \
      || echo "bootstrap: warning: npm could not install s3rver@$S3RVER_VERSION; the tests against it cannot run" >&2
  fi
fi
[ $# -gt 0 ] && shift
case "$what" in
  demo)  exec .venv/bin/ckptd demo "$@" ;;
  # three tests at a time (on 2 cores: much of a test is waiting on its daemon and rank processes), each test
  # file in one worker (its module-scoped servers once, its tests in order); CKPTD_TEST_WORKERS=0: one by one
  test)  exec .venv/bin/python -m pytest -n "${CKPTD_TEST_WORKERS:-3}" --dist loadfile "$@" ;;
  bench) exec .venv/bin/python benchmarks/run.py "$@" ;;
  setup) echo "bootstrap: ready (.venv/bin/ckptd)" >&2 ;;
  *) echo "usage: $0 demo|test|bench|setup [args]" >&2; exit 2 ;;
esac
