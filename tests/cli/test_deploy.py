"""deploy/ agrees with the code it deploys: container commands parse with the real `cde` argument
parsers, probes hit the ports and public paths the gateway serves, the gateway finds the workers'
headless Service, key files are where the flags point, the dashboard uses only exported metrics,
and the gateway image's package list covers what a gateway process imports (and holds no torch)."""

import argparse
import importlib
import json
import re
import subprocess
import sys
import tomllib

import yaml
from cde.gateway.metrics import Metrics
from cde.gateway.middleware import PUBLIC_PATHS

from tests.api_server import REPO

DEPLOY = REPO / "deploy"
# What the dashboard must chart: the per-worker gauges (one name each) and the responses by status.
CHARTED = {
    "cde_worker_waiting_requests",
    "cde_worker_running_requests",
    "cde_worker_kv_pages_used",
    "cde_worker_kv_pages_total",
    "cde_http_responses_total",
}


def cli(command: str, args: list[str]) -> argparse.Namespace:
    """Parses a container's arguments with the real `cde COMMAND` parser (exits on an unknown flag)."""
    assert args[:2] == ["cde", command], args
    parser = argparse.ArgumentParser(prog=f"cde {command}")
    importlib.import_module(f"cde.commands.{command}").add_arguments(parser)
    return parser.parse_args(args[2:])


def manifests() -> dict[str, dict]:
    docs = [
        d
        for f in sorted((DEPLOY / "k8s").glob("*.yaml"))
        if f.name != "kustomization.yaml"
        for d in yaml.safe_load_all(f.read_text())
    ]
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in docs}


def container(workload: dict) -> dict:
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    return c


def port_of(c: dict, ref) -> int:
    return ref if isinstance(ref, int) else {p["name"]: p["containerPort"] for p in c["ports"]}[ref]


def secret_files(workload: dict, c: dict) -> set[str]:
    """Paths inside the container of the files that secret volumes project."""
    volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
    return {
        f"{m['mountPath']}/{item['path']}"
        for m in c["volumeMounts"]
        if "secret" in volumes[m["name"]]
        for item in volumes[m["name"]]["secret"]["items"]
    }


def dockerfile(name: str) -> tuple[str, list[str], list[str]]:
    text = (DEPLOY / name).read_text()
    entry = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.MULTILINE).group(1))
    cmd = re.search(r"^CMD (\[.*\])$", text, re.MULTILINE)
    return text, entry, json.loads(cmd.group(1)) if cmd else []


def test_kubernetes_gateway_discovers_the_worker_statefulset():
    m = manifests()
    workers, headless = m["StatefulSet/cde-worker"], m["Service/cde-worker"]
    assert workers["spec"]["serviceName"] == "cde-worker" and headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"] == workers["spec"]["template"]["metadata"]["labels"]
    wc = container(workers)
    bind_port = int(cli("worker", wc["command"] + wc["args"]).bind.rsplit(":", 1)[1])
    (svc_port,) = headless["spec"]["ports"]
    assert svc_port["port"] == port_of(wc, svc_port["targetPort"]) == bind_port

    gc = container(m["Deployment/cde-gateway"])
    gateway_args = cli("gateway", gc["command"] + gc["args"])
    assert gateway_args.worker_dns == [("cde-worker", bind_port)] and gateway_args.worker == []


def test_kubernetes_probes_match_the_servers():
    m = manifests()
    wc = container(m["StatefulSet/cde-worker"])
    assert wc["resources"]["limits"] == {"nvidia.com/gpu": 1}
    bind_port = int(cli("worker", wc["command"] + wc["args"]).bind.rsplit(":", 1)[1])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert port_of(wc, wc[probe]["tcpSocket"]["port"]) == bind_port

    gateway = m["Deployment/cde-gateway"]
    gc = container(gateway)
    http_port = cli("gateway", gc["command"] + gc["args"]).port
    assert gc["readinessProbe"]["httpGet"]["path"] == "/health"
    for probe in ("readinessProbe", "livenessProbe"):
        get = gc[probe]["httpGet"]
        assert port_of(gc, get["port"]) == http_port and get["path"] in PUBLIC_PATHS  # open with --api-key
    meta = gateway["spec"]["template"]["metadata"]["annotations"]
    assert int(meta["prometheus.io/port"]) == http_port and meta["prometheus.io/path"] in PUBLIC_PATHS
    service = m["Service/cde-gateway"]
    assert port_of(gc, service["spec"]["ports"][0]["targetPort"]) == http_port


def test_kubernetes_curve_keys_are_mounted_where_the_flags_point():
    m = manifests()
    wl, gw = m["StatefulSet/cde-worker"], m["Deployment/cde-gateway"]
    w = cli("worker", container(wl)["command"] + container(wl)["args"])
    g = cli("gateway", container(gw)["command"] + container(gw)["args"])
    assert {w.curve_secret_key, w.curve_authorized_keys} == secret_files(wl, container(wl))
    assert {g.curve_secret_key, g.curve_server_key} == secret_files(gw, container(gw))
    # Each side holds its own secret and only the other side's public key.
    assert w.curve_secret_key.endswith("worker.key_secret") and g.curve_server_key.endswith("worker.key")
    assert g.curve_secret_key.endswith("gateway.key_secret") and w.curve_authorized_keys.endswith("gateway.key")


def test_compose_two_gpu_workers_behind_the_gateway():
    services = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]
    _, worker_entry, _ = dockerfile("Dockerfile.worker")
    _, gateway_entry, _ = dockerfile("Dockerfile.gateway")
    workers = {name: s for name, s in services.items() if name.startswith("worker-")}
    gpus = []
    for s in workers.values():
        args = cli("worker", worker_entry + s["command"])
        (device,) = s["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"] and len(device["device_ids"]) == 1
        gpus += device["device_ids"]
        port = int(args.bind.rsplit(":", 1)[1])
        assert f"('127.0.0.1', {port})" in s["healthcheck"]["test"][-1]
    assert len(workers) == 2 and len(set(gpus)) == 2

    gateway = services["gateway"]
    args = cli("gateway", gateway_entry + gateway["command"])
    assert sorted(args.worker) == sorted(f"tcp://{name}:{port}" for name in workers)
    assert gateway["ports"] == [f"{args.port}:{args.port}"]
    assert f"http://127.0.0.1:{args.port}/health" in gateway["healthcheck"]["test"][-1]


def test_dockerfiles_expose_what_their_commands_use():
    text, entry, cmd = dockerfile("Dockerfile.worker")
    assert f"EXPOSE {cli('worker', entry + cmd).bind.rsplit(':', 1)[1]}" in text
    text, entry, _ = dockerfile("Dockerfile.gateway")
    port = cli("gateway", entry + ["--worker-dns", "w:5555"]).port
    assert f"EXPOSE {port}" in text and f"127.0.0.1:{port}/health" in text
    # The gateway image installs every package CDE's pyproject names, without pyproject's deps.
    copied = set(re.findall(r"^COPY (\w+) \1$", text, re.MULTILINE))
    assert copied == {"cde", "shared", "gateway", "worker", "kernels"} and "--no-deps ." in text


def test_gateway_image_requirements_cover_the_gateway_imports():
    code = """
import argparse, importlib.metadata as md, sys
import cde.cli, cde.gateway.app, cde.gateway.http_server, cde.gateway.discovery, cde.shared.curve, pyarrow.parquet
from cde.commands import gateway
gateway.add_arguments(argparse.ArgumentParser())
dists = md.packages_distributions()
print(" ".join(sorted({d for m in list(sys.modules) for d in dists.get(m.split(".")[0], [])})))
"""
    loaded = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
    required = {}
    for line in (DEPLOY / "gateway-requirements.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, spec = re.match(r"([A-Za-z0-9_.-]+)(\S*)", line).groups()
            required[norm(name)] = spec
    assert "torch" not in required
    # Transitive dependencies come with these; setuptools is the venv's own .pth hook.
    transitive = {
        "annotated-types",
        "anyio",
        "click",
        "h11",
        "idna",
        "pydantic-core",
        "typing-inspection",
        "typing-extensions",
        "sniffio",
        "regex",
        "requests",
        "numpy",
        "setuptools",
        "cde",
    }
    missing = {norm(d) for d in loaded.stdout.split()} - set(required) - transitive
    assert not missing, f"the gateway imports {missing}: add them to deploy/gateway-requirements.txt"
    # Same version floors as pyproject.toml, so the image and `pip install cde` agree.
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = {
        norm(m.group(1)): m.group(2)
        for dep in project["dependencies"] + project["optional-dependencies"]["test"]
        if (m := re.match(r"([A-Za-z0-9_.-]+)(\S*)", dep.replace(" ", "")))
    }
    assert {n: declared[n] for n in required} == required


def test_grafana_dashboard_uses_exported_metrics():
    exported = set()
    for family in Metrics().registry.collect():
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}.get(family.type, [""])
        exported |= {family.name + s for s in suffixes}
    dash = json.loads((DEPLOY / "grafana" / "cde.json").read_text())
    used = set()
    for panel in dash["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            used |= set(re.findall(r"\bcde_\w+", target["expr"]))
    assert used <= exported, used - exported
    assert used >= CHARTED and {"cde_worker_up", "cde_time_to_first_block_seconds_bucket"} <= used
