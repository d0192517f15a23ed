#!/usr/bin/env bash
# vLLM's own offloading test suites, run with kvoffload in place of vLLM's
# CPU manager and spec (scripts/vllm_conformance_plugin.py). Results and the
# reasons for failures: docs/CONFORMANCE.md.
#
#   scripts/vllm_conformance.sh [--baseline] [pytest args...]
#
# VLLM_PYTHON: a Python with vLLM 0.33 and kvoffload importable
#   (default /work/vllm033/bin/python; see docs/CONFORMANCE.md to make one).
# --baseline: the same tests without the substitution (vLLM's own CPU tier).
# The vLLM sdist (tests are not in the wheel) is fetched from PyPI once,
# checked against PyPI's sha256, and cached in $KVOFFLOAD_CACHE (~/.cache/kvoffload).
# A JUnit report and a per-file summary are written to $OUT (default ./conformance-out).
set -euo pipefail

VERSION=0.33.0
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${VLLM_PYTHON:-/work/vllm033/bin/python}
CACHE=${KVOFFLOAD_CACHE:-$HOME/.cache/kvoffload}
OUT=${OUT:-$PWD/conformance-out}
MODE=kvoffload
if [[ ${1:-} == --baseline ]]; then MODE=baseline; shift; fi

[[ -x $PY ]] || { echo "vllm_conformance: no Python at $PY (set VLLM_PYTHON)" >&2; exit 2; }
"$PY" -c "import vllm, sys; v = vllm.__version__; sys.exit(0 if v.startswith('$VERSION') else 'vLLM ' + v + ' at $PY, need $VERSION')"
mkdir -p "$CACHE" "$OUT"
SDIST=$CACHE/vllm-$VERSION.tar.gz
if [[ ! -s $SDIST ]]; then
  # pip download --no-binary builds metadata (needs vLLM's build tools): ask PyPI for the file instead
  "$PY" - "$VERSION" "$SDIST" <<'EOF'
import hashlib, json, sys, urllib.request
version, dest = sys.argv[1], sys.argv[2]
# PyPI's Simple API (PEP 691 JSON), the one pip uses
req = urllib.request.Request("https://pypi.org/simple/vllm/",
                             headers={"Accept": "application/vnd.pypi.simple.v1+json"})
with urllib.request.urlopen(req, timeout=60) as r:
    files = [f for f in json.load(r)["files"] if f["filename"] == f"vllm-{version}.tar.gz"]
if not files:
    sys.exit(f"PyPI lists no sdist for vllm {version}")
f = files[0]
with urllib.request.urlopen(f["url"], timeout=600) as r:
    data = r.read()
if hashlib.sha256(data).hexdigest() != f["hashes"]["sha256"]:
    sys.exit(f"sha256 mismatch for {f['url']}")
with open(dest + ".part", "wb") as out:
    out.write(data)
import os
os.replace(dest + ".part", dest)
print(f"fetched {f['filename']} ({len(data) >> 20} MiB)", file=sys.stderr)
EOF
fi

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
tar xzf "$SDIST" -C "$WORK" "vllm-$VERSION/tests" "vllm-$VERSION/pyproject.toml"
SRC=$WORK/vllm-$VERSION
# vLLM's top-level conftest imports its whole model-test harness (tblib, media
# assets, HF runners); none of it is used by these suites.
: > "$SRC/tests/conftest.py"
SUITES=(tests/v1/kv_offload)
for d in "$SRC"/tests/v1/kv_connector/unit/offloading_connector*; do SUITES+=("${d#"$SRC"/}"); done

PLUGIN=()
[[ $MODE == kvoffload ]] && PLUGIN=(-p vllm_conformance_plugin)
cd "$SRC"
set +e
# Offline: tests that name a Hub model (facebook/opt-125m) fail at once instead of hanging.
PYTHONPATH="$REPO/scripts:$REPO/src${PYTHONPATH:+:$PYTHONPATH}" VLLM_TARGET_DEVICE=cpu \
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  "$PY" -m pytest -q -p no:cacheprovider "${PLUGIN[@]}" --tb=line -rfE --timeout 60 \
  --junit-xml="$OUT/$MODE.xml" -o junit_family=xunit1 "${SUITES[@]}" "$@"
RC=$?
set -e
"$PY" - "$OUT/$MODE.xml" > "$OUT/$MODE-summary.txt" <<'EOF'
import collections, sys, xml.etree.ElementTree as ET
counts = collections.defaultdict(collections.Counter)
for case in ET.parse(sys.argv[1]).iter("testcase"):
    f = case.get("file") or case.get("classname", "?").replace(".", "/") + ".py"
    kinds = {c.tag for c in case}
    kind = ("failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed")
    counts[f][kind] += 1
print(f"{'file':70} {'passed':>7} {'failed':>7} {'skipped':>7}")
for f in sorted(counts):
    c = counts[f]
    print(f"{f:70} {c['passed']:7} {c['failed']:7} {c['skipped']:7}")
tot = sum(counts.values(), collections.Counter())
print(f"{'total':70} {tot['passed']:7} {tot['failed']:7} {tot['skipped']:7}")
EOF
cat "$OUT/$MODE-summary.txt"
exit $RC
