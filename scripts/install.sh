#!/usr/bin/env bash
# Install cosyvoice-cpu from this checkout.
#   scripts/install.sh        the package with the PyTorch reference and exporters ([export])
#   scripts/install.sh --dev  also the server (with Ray Serve for --replicas, and the Wyoming protocol), the test
#                             tools and the official CosyVoice code the parity tests compare to (the web-page test
#                             also needs Debian's chromium: .ci/run installs it)
# CPU PyTorch goes first: anything that asks for an unpinned torch would otherwise pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
pip() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

pip torch==2.13.0
if [[ "${1:-}" == "--dev" ]]; then
    pip -e ".[export,bench,text,server,wyoming,openvino,openvino-export,ray,dev]" -r tests/parity/requirements.txt
    # the official model code and whisper's log-mel/tokenizer, without their CUDA/onnxruntime-gpu pins
    pip --no-deps token2wav-cosyvoice==0.1.0 openai-whisper==20250625
else
    pip -e ".[export]"
fi
"$PY" -c "import cosyvoice_cpu, torch; print('cosyvoice-cpu', cosyvoice_cpu.__version__, 'with torch', torch.__version__)"
