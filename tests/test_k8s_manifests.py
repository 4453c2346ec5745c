"""docker/k8s: valid against Kubernetes' own schemas (offline, strict: unknown fields fail), and wired as
the scale-out design needs (affinity on X-Session-ID, probes, drain, Redis bounded by its memory)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

K8S = Path(__file__).resolve().parents[1] / "docker" / "k8s"
VALIDATE = shutil.which("kubernetes-validate", path=str(Path(sys.executable).parent))
MANIFESTS = sorted(K8S.glob("*.yaml"))


def documents() -> dict[tuple[str, str], dict]:
    found = {}
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            found[(doc["kind"], doc["metadata"]["name"])] = doc
    return found


@pytest.mark.skipif(VALIDATE is None, reason="kubernetes-validate (a dev dependency) is not installed")
@pytest.mark.parametrize("version", ["1.30.0", None], ids=["k8s-1.30", "latest"])
def test_the_manifests_are_valid_kubernetes(version):
    args = [VALIDATE, "--strict", *(["--kubernetes-version", version] if version else []), *map(str, MANIFESTS)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("passed") == len(documents())


def test_the_manifests_wire_affinity_probes_drain_and_redis_for_records_and_blocks():
    docs = documents()
    ingress = docs[("Ingress", "kvserve")]
    assert ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/upstream-hash-by"] == "$http_x_session_id"
    assert ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"
    # A POST whose pod failed before answering goes to the next pod, as with docker/scale/nginx.conf.
    retried = ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/proxy-next-upstream"].split()
    assert {"error", "non_idempotent"} <= set(retried)

    pod = docs[("Deployment", "kvserve")]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    redis_service = docs[("Service", "kvserve-redis")]
    port = redis_service["spec"]["ports"][0]["port"]
    assert env["KVSERVE_SHARED_URL"]["value"] == f"redis://kvserve-redis:{port}/0"
    assert env["KVSERVE_REPLICA_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    # One dtype for every replica (their K/V must match to be shared): a pinned models.toml from a ConfigMap.
    mount = next(m for m in container["volumeMounts"] if env["KVSERVE_MODELS_FILE"]["value"].startswith(m["mountPath"]))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    models = tomllib.loads(docs[("ConfigMap", volume["configMap"]["name"])]["data"]["models.toml"])["models"]
    assert models
    assert all(m["dtype"] != "auto" for m in models)
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert "preStop" in container["lifecycle"]
    grace = float(env["KVSERVE_SHUTDOWN_GRACE_S"]["value"])
    assert pod["terminationGracePeriodSeconds"] > grace + container["lifecycle"]["preStop"]["sleep"]["seconds"]

    # Records and leases: a Redis that never evicts (kvserve refuses one that could) and keeps its data.
    records = docs[("StatefulSet", "kvserve-redis")]["spec"]["template"]["spec"]["containers"][0]
    args = records["args"]
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
    assert args[args.index("--appendonly") + 1] == "yes"
    data = next(m for m in records["volumeMounts"] if m["mountPath"] == args[args.index("--dir") + 1])
    claims = docs[("StatefulSet", "kvserve-redis")]["spec"]["volumeClaimTemplates"]
    assert data["name"] in {c["metadata"]["name"] for c in claims}
    # K/V blocks: a cache in a Redis of its own, bounded below its container's memory, evicting the oldest.
    blocks_service = docs[("Service", "kvserve-redis-blocks")]
    blocks_port = blocks_service["spec"]["ports"][0]["port"]
    assert env["KVSERVE_SHARED_BLOCKS_URL"]["value"] == f"redis://kvserve-redis-blocks:{blocks_port}/0"
    blocks = docs[("StatefulSet", "kvserve-redis-blocks")]["spec"]["template"]["spec"]["containers"][0]
    args = blocks["args"]
    maxmemory = args[args.index("--maxmemory") + 1]
    assert maxmemory.endswith("mb")
    assert int(maxmemory[:-2]) * 2**20 < 2**30  # below the container's 1Gi limit
    assert blocks["resources"]["limits"]["memory"] == "1Gi"
    assert args[args.index("--maxmemory-policy") + 1] == "allkeys-lru"
