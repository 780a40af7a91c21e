#!/usr/bin/env python3
"""Checks of the rendered deploy/k8s that a schema cannot express: the objects are all there and
refer to each other (selectors, ConfigMap, Secret, probe ports), probes hit the server's health
routes, the termination grace covers the drain, a GPU is requested, the pods run as non-root,
every EXACTSCORE_* variable is one the server has (README.md's Configuration table).

    python3 scripts/check_k8s.py RENDERED.yaml README.md

Prints one line per failed check and exits 1 if any failed. Needs PyYAML.
"""
import re
import sys

import yaml


def main(rendered, readme_path):
    docs = [d for d in yaml.safe_load_all(open(rendered, encoding="utf-8")) if d]
    errors = []

    def check(ok, message):
        if not ok:
            errors.append(message)
        return ok

    by_kind = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    for kind in ("Deployment", "Service", "ConfigMap", "Secret", "PodDisruptionBudget"):
        check(kind in by_kind, f"no {kind} in the kustomization")
    if errors:
        return errors

    readme = open(readme_path, encoding="utf-8").read()
    section = readme.split("\n## Configuration\n", 1)[1].split("\n## ", 1)[0]
    known_env = set(re.findall(r"`(EXACTSCORE_[A-Z0-9_]+)`", section))
    check(known_env, "README.md's Configuration table names no EXACTSCORE_* variable")

    configmaps = {c["metadata"]["name"]: c.get("data", {}) for c in by_kind["ConfigMap"]}
    secrets = {
        s["metadata"]["name"]: set(s.get("data", {})) | set(s.get("stringData", {}))
        for s in by_kind["Secret"]
    }
    for name, data in configmaps.items():
        for key in data:
            check(key in known_env, f"ConfigMap {name}: {key} is not a server variable (README)")

    for dep in by_kind["Deployment"]:
        name = dep["metadata"]["name"]
        pod = dep["spec"]["template"]
        labels = pod["metadata"].get("labels", {})
        selector = dep["spec"]["selector"]["matchLabels"]
        check(selector.items() <= labels.items(), f"Deployment {name}: selector misses its pods")
        spec = pod["spec"]
        sc = spec.get("securityContext", {})
        check(sc.get("runAsNonRoot") is True, f"Deployment {name}: runAsNonRoot is not true")
        check(sc.get("runAsUser", 0) != 0, f"Deployment {name}: runAsUser is 0")
        check(len(spec["containers"]) == 1, f"Deployment {name}: expected one container")
        c = spec["containers"][0]
        ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}

        env = {}
        for src in c.get("envFrom", []):
            ref = src.get("configMapRef", {}).get("name")
            if check(ref in configmaps, f"Deployment {name}: envFrom ConfigMap {ref} not rendered"):
                env.update(configmaps[ref])
        for e in c.get("env", []):
            if e["name"].startswith("EXACTSCORE_"):
                check(e["name"] in known_env, f"Deployment {name}: env {e['name']} is not a server variable")
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                check(
                    ref["key"] in secrets.get(ref["name"], set()),
                    f"Deployment {name}: Secret {ref['name']} has no key {ref['key']}",
                )
            elif "value" in e:
                env[e["name"]] = e["value"]
        check("EXACTSCORE_API_KEY" in {e["name"] for e in c.get("env", [])},
              f"Deployment {name}: EXACTSCORE_API_KEY does not come from a Secret")
        check(env.get("EXACTSCORE_HOST") == "0.0.0.0",
              f"Deployment {name}: EXACTSCORE_HOST must be 0.0.0.0 (the default 127.0.0.1 is unreachable)")
        port = int(env.get("EXACTSCORE_PORT", 8000))
        check(port in ports.values(), f"Deployment {name}: no containerPort {port} (EXACTSCORE_PORT)")

        for probe, path in (("startupProbe", "/health/ready"), ("readinessProbe", "/health/ready"),
                            ("livenessProbe", "/health/live")):
            get = c.get(probe, {}).get("httpGet")
            if not check(get, f"Deployment {name}: no {probe} httpGet"):
                continue
            check(get["path"] == path, f"Deployment {name}: {probe} path {get['path']}, expected {path}")
            p = ports.get(get["port"], get["port"])
            check(p == port, f"Deployment {name}: {probe} port {get['port']} is not the server's {port}")

        # Drain: after SIGTERM the server lets admitted requests finish for at most the drain
        # timeout (server default 30 s), and none outlives the request timeout (default 600 s);
        # a preStop pause comes first.
        drain = min(int(env.get("EXACTSCORE_REQUEST_TIMEOUT_SECS", 600)),
                    int(env.get("EXACTSCORE_DRAIN_TIMEOUT_SECS", 30)))
        pause = 0
        cmd = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
        if len(cmd) == 2 and cmd[0] == "sleep":
            pause = int(cmd[1])
        grace = spec.get("terminationGracePeriodSeconds", 30)
        check(grace > pause + drain,
              f"Deployment {name}: terminationGracePeriodSeconds {grace} <= preStop {pause} s "
              f"+ drain {drain} s")

        limits = c.get("resources", {}).get("limits", {})
        check(str(limits.get("nvidia.com/gpu", "0")) not in ("0", ""),
              f"Deployment {name}: no nvidia.com/gpu limit")
        if str(env.get("EXACTSCORE_DEVICE", "cpu")).startswith("cuda"):
            check("nvidia.com/gpu" in limits, f"Deployment {name}: cuda device without a GPU limit")

        vols = {v["name"] for v in spec.get("volumes", [])}
        for m in c.get("volumeMounts", []):
            check(m["name"] in vols, f"Deployment {name}: volumeMount {m['name']} has no volume")
        model = env.get("EXACTSCORE_MODEL")
        check(any(m["mountPath"] == model for m in c.get("volumeMounts", [])),
              f"Deployment {name}: EXACTSCORE_MODEL {model} is not a mounted volume")

        services = by_kind["Service"]
        for s in services:
            sel = s["spec"].get("selector", {})
            check(sel and sel.items() <= labels.items(),
                  f"Service {s['metadata']['name']}: selector does not match Deployment {name}")
            for sp in s["spec"]["ports"]:
                tp = sp.get("targetPort", sp["port"])
                check(ports.get(tp, tp) == port,
                      f"Service {s['metadata']['name']}: targetPort {tp} is not the server's {port}")
        headless = [s for s in services if s["spec"].get("clusterIP") == "None"]
        if check(headless, "no headless Service (clusterIP: None) for client fan-out"):
            for s in headless:
                check(not s["spec"].get("publishNotReadyAddresses", False),
                      f"Service {s['metadata']['name']}: publishes pods that are not ready")
                check(any(sp["port"] == port for sp in s["spec"]["ports"]),
                      f"Service {s['metadata']['name']}: clients use the pods' port {port}: list it")
        for pdb in by_kind["PodDisruptionBudget"]:
            sel = pdb["spec"]["selector"].get("matchLabels", {})
            check(sel and sel.items() <= labels.items(),
                  f"PodDisruptionBudget {pdb['metadata']['name']}: selector does not match {name}")
            replicas = dep["spec"].get("replicas", 1)
            mu = pdb["spec"].get("maxUnavailable")
            check(mu is None or (isinstance(mu, int) and 0 < mu < max(replicas, 2)),
                  f"PodDisruptionBudget {pdb['metadata']['name']}: maxUnavailable {mu!r} with {replicas} replicas")
    return errors


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    found = main(sys.argv[1], sys.argv[2])
    for e in found:
        print(f"FAIL {e}")
    if found:
        sys.exit(1)
    print("check_k8s: all checks passed")
