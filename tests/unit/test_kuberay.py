"""The deployable cluster (config/kuberay/, Dockerfile): manifests valid for the operator's CRD,
pods that fit their nodes, the Serve config each embeds, the image's install line."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from fastserve.config import AppArgs

ROOT = Path(__file__).resolve().parents[2]
KUBERAY = ROOT / "config" / "kuberay"
MANIFESTS = ("rayservice-opt175b.yaml", "rayservice-demo.yaml")
#: The Serve config each RayService embeds, and what may differ (a pod must listen beyond localhost).
EMBEDS = {"rayservice-opt175b.yaml": ("opt175b.yaml", {}),
          "rayservice-demo.yaml": ("opt125m-dummy.yaml", {"proxy_location": "EveryNode", "host": "0.0.0.0",
                                                 "require_api_key": True})}
UNITS = {"": 1, "m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9}


def quantity(value: Any) -> float:
    """A Kubernetes resource quantity ("500m", "64Gi", 8) as a number (cores, bytes, devices)."""
    match = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", str(value))
    assert match and match.group(2) in UNITS, f"unparsed quantity {value!r}"
    return float(match.group(1)) * UNITS[match.group(2)]


def documents(name: str) -> dict[str, dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all((KUBERAY / name).read_text()) if d]
    by_kind = {d["kind"]: d for d in docs}
    assert len(by_kind) == len(docs), f"{name}: one object per kind"
    return by_kind


@pytest.fixture(scope="module")
def crd_schema() -> dict[str, Any]:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)   # the CRD is 1 MB: use libyaml when present
    crd = yaml.load((KUBERAY / "crd" / "ray.io_rayservices.yaml").read_text(), Loader=loader)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    assert version["served"] and crd["spec"]["names"]["kind"] == "RayService"
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return schema


def pod_groups(service: dict[str, Any]) -> dict[str, dict[str, Any]]:
    cluster = service["spec"]["rayClusterConfig"]
    groups = {"head": cluster["headGroupSpec"]}
    groups.update({g["groupName"]: g for g in cluster["workerGroupSpecs"]})
    return groups


@pytest.mark.parametrize("name", MANIFESTS)
def test_rayservice_validates_against_the_operators_crd(name: str, crd_schema: dict[str, Any]) -> None:
    service = documents(name)["RayService"]
    assert service["apiVersion"] == "ray.io/v1"
    jsonschema.Draft7Validator(crd_schema).validate(service)


@pytest.mark.parametrize("name", MANIFESTS)
def test_embedded_serve_config_is_the_shipped_one(name: str) -> None:
    import ray

    service = documents(name)["RayService"]
    embedded = yaml.safe_load(service["spec"]["serveConfigV2"])
    source, changes = EMBEDS[name]
    expected = yaml.safe_load((ROOT / "config" / source).read_text())
    if "proxy_location" in changes:
        expected["proxy_location"] = changes["proxy_location"]
    if "host" in changes:
        expected["http_options"]["host"] = changes["host"]
    if "require_api_key" in changes:
        expected["applications"][0]["args"]["server"]["require_api_key"] = changes["require_api_key"]
    assert embedded == expected
    # Reachable beyond the pod: the ingress must refuse to start without an API key.
    assert embedded["http_options"]["host"] == "0.0.0.0"
    assert embedded["applications"][0]["args"]["server"]["require_api_key"] is True
    assert service["spec"]["rayClusterConfig"]["rayVersion"] == ray.__version__
    (app,) = embedded["applications"]
    AppArgs.model_validate(app["args"], context={"require_profile": False})


@pytest.mark.parametrize("name", MANIFESTS)
def test_every_pod_fits_the_node_shape_written_beside_it(name: str) -> None:
    shapes = yaml.safe_load((KUBERAY / "node-shapes.yaml").read_text())
    placements = shapes["placements"][name]
    groups = pod_groups(documents(name)["RayService"])
    assert set(placements) == set(groups)
    per_node: dict[str, dict[str, float]] = {}
    for group, spec in groups.items():
        node = shapes["nodes"][placements[group]]
        allocatable = {k: quantity(v) - quantity(node["reserved"].get(k, 0)) for k, v in node["capacity"].items()}
        (container,) = spec["template"]["spec"]["containers"]
        res = container["resources"]
        assert res["requests"] == res["limits"], f"{group}: Guaranteed QoS (requests = limits)"
        for key, value in res["requests"].items():
            assert quantity(value) <= allocatable.get(key, 0), f"{name} {group}: {key} {value} > {allocatable}"
            if key == "nvidia.com/gpu":   # a GPU pod takes its whole node
                assert quantity(value) == allocatable[key]
        if name == "rayservice-demo.yaml":   # every pod on one node: they must fit together
            node_total = per_node.setdefault(placements[group], {})
            for key, value in res["requests"].items():
                node_total[key] = node_total.get(key, 0.0) + quantity(value) * spec.get("replicas", 1)
                assert node_total[key] <= allocatable[key], f"{name}: pods exceed one node's {key}"


def test_a_model_copy_fits_the_gpu_pods_and_autoscaling_has_room() -> None:
    service = documents("rayservice-opt175b.yaml")["RayService"]
    serve = yaml.safe_load(service["spec"]["serveConfigV2"])
    (app,) = serve["applications"]
    args = AppArgs.model_validate(app["args"], context={"require_profile": False})
    (gpu_group,) = [g for g in pod_groups(service).values() if "nvidia.com/gpu" in
                    g["template"]["spec"]["containers"][0]["resources"]["requests"]]
    requests = gpu_group["template"]["spec"]["containers"][0]["resources"]["requests"]
    gpus, cpus = quantity(requests["nvidia.com/gpu"]), quantity(requests["cpu"])
    bundles = args.placement_group_bundles()
    stages = bundles[1:]
    assert len(stages) == args.parallel.pipeline_parallel_size == 2
    for stage in stages:   # one stage per pod: its TP ranks share a bundle, a bundle one node
        assert stage["GPU"] == gpus and stage["CPU"] <= cpus
    (engine,) = [d for d in app["deployments"] if d["name"] == "Engine"]
    scaling = engine["autoscaling_config"]
    assert gpu_group["minReplicas"] * gpus >= scaling["min_replicas"] * args.parallel.world_size
    assert gpu_group["maxReplicas"] * gpus >= scaling["max_replicas"] * args.parallel.world_size


def test_weights_volume_is_defined_read_only_many_and_mounted_at_model_path() -> None:
    docs = documents("rayservice-opt175b.yaml")
    claim = docs["PersistentVolumeClaim"]
    assert claim["spec"]["accessModes"] == ["ReadOnlyMany"]
    service = docs["RayService"]
    serve = yaml.safe_load(service["spec"]["serveConfigV2"])
    model_path = serve["applications"][0]["args"]["model"]["model_path"]
    gpu = pod_groups(service)["gpu-a100x8"]["template"]["spec"]
    (volume,) = [v for v in gpu["volumes"] if "persistentVolumeClaim" in v]
    assert volume["persistentVolumeClaim"] == {"claimName": claim["metadata"]["name"], "readOnly": True}
    (mount,) = [m for m in gpu["containers"][0]["volumeMounts"] if m["name"] == volume["name"]]
    assert mount["mountPath"] == model_path and mount["readOnly"] is True


@pytest.mark.parametrize("name", MANIFESTS)
def test_pod_monitor_scrapes_rays_metrics_port_on_every_pod(name: str) -> None:
    docs = documents(name)
    monitor = docs["PodMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    selector = monitor["spec"]["selector"]["matchLabels"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    for group, spec in pod_groups(docs["RayService"]).items():
        labels = spec["template"]["metadata"]["labels"]
        # ray.io/* labels are KubeRay's own, set on every pod it creates; ours must be in the template
        assert all(labels.get(k) == v for k, v in selector.items() if not k.startswith("ray.io/")), group
        port = spec["rayStartParams"]["metrics-export-port"]
        (container,) = spec["template"]["spec"]["containers"]
        assert {"containerPort": int(port), "name": endpoint["port"]} in container["ports"], group


def test_dockerfile_installs_pyproject_extras_on_the_matching_ray_image() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = set(project["optional-dependencies"])
    args = dict(re.findall(r"^ARG (\w+)=(\S*)$", dockerfile, flags=re.M))
    assert args["EXTRAS"] == "gpu" and "gpu" in extras
    (install,) = re.findall(r"^RUN pip install .*$", dockerfile, flags=re.M)
    assert install == 'RUN pip install --no-cache-dir -e ".[${EXTRAS}]"'
    # every extra the build instructions and manifests name exists
    named = [e for group in re.findall(r"--build-arg EXTRAS=([\w,-]+)", dockerfile) for e in group.split(",")]
    assert set(named) == {"gpu", "cpu", "serve-llm"} and set(named) <= extras
    ray_pin = next(d for d in project["dependencies"] if d.startswith("ray["))
    assert ray_pin == "ray[serve]>=2.60,<2.61"
    # Ray's CUDA 13 images are built for Python 3.12 (tests/unit/test_cuda_major.py: the CUDA major).
    assert re.fullmatch(r"rayproject/ray:2\.60\.0-py312-cu\d+", args["RAY_IMAGE"])
    assert project["requires-python"] == ">=3.11"
    for name in MANIFESTS:
        for spec in pod_groups(documents(name)["RayService"]).values():
            image = spec["template"]["spec"]["containers"][0]["image"]
            assert image.startswith(f"fastserve-ray:{project['version']}-"), image


@pytest.mark.parametrize("name", MANIFESTS)
def test_every_pod_gets_the_api_key_from_a_secret(name: str) -> None:
    from fastserve.config_server import API_KEY_ENV

    for group, spec in pod_groups(documents(name)["RayService"]).items():
        (container,) = spec["template"]["spec"]["containers"]
        (env,) = [e for e in container["env"] if e["name"] == API_KEY_ENV]
        assert env["valueFrom"]["secretKeyRef"] == {"name": "fastserve-api-key", "key": "key"}, group


@pytest.mark.parametrize("name", MANIFESTS)
def test_upgrades_never_build_a_second_full_cluster(name: str) -> None:
    """KubeRay's default upgrade (NewCluster) brings up a whole second cluster before switching;
    an incremental one may surge by at most its maxSurgePercent of the cluster."""
    strategy = documents(name)["RayService"]["spec"]["upgradeStrategy"]
    if strategy["type"] == "NewClusterWithIncrementalUpgrade":
        assert strategy["clusterUpgradeOptions"]["maxSurgePercent"] < 100
    else:
        assert strategy == {"type": "None"}


def test_dockerfile_has_a_c_compiler_and_builds_the_cpu_kernel() -> None:
    """Without a compiler the CPU decode attention silently falls back to the torch reference."""
    from fastserve.kernels import cpu_ops

    dockerfile = (ROOT / "Dockerfile").read_text()
    (apt,) = re.findall(r"^RUN apt-get update && apt-get install .*$", dockerfile, flags=re.M)
    assert " gcc " in apt and "libgomp1" in apt
    build = 'RUN python -c "from fastserve.kernels import cpu_ops; cpu_ops.build(cpu_ops.PAGED_ATTENTION_SOURCE)"'
    assert build in dockerfile.splitlines()
    assert dockerfile.index(apt) < dockerfile.index(build)
    assert cpu_ops.build(cpu_ops.PAGED_ATTENTION_SOURCE).exists()   # the step's own command works here


def test_dockerfile_installs_the_no_deps_requirements_with_serve_llm() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert ("RUN case \",${EXTRAS},\" in *,serve-llm,*) pip install --no-cache-dir --no-deps "
            "-r config/requirements-nodeps.txt;; esac") in dockerfile.splitlines()


def test_gpu_pods_set_nccl_networking_and_cpu_pods_run_the_cpu_image() -> None:
    """Between GPU pods NCCL must be told its interface (the pod network) and that there is no
    InfiniBand unless one is wired in; pods without GPUs take the CPU image, not CUDA's."""
    groups = pod_groups(documents("rayservice-opt175b.yaml")["RayService"])
    for group, spec in groups.items():
        (container,) = spec["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        gpus = container["resources"]["limits"].get("nvidia.com/gpu", 0)
        if gpus:
            assert container["image"].endswith("-cu130"), group
            assert env["NCCL_SOCKET_IFNAME"] and env["NCCL_IB_DISABLE"] == "1", group
        else:
            assert container["image"].endswith("-cpu"), group
            assert not any(k.startswith("NCCL_") for k in env), group
    text = (KUBERAY / "rayservice-opt175b.yaml").read_text()
    # The InfiniBand variant is written out, commented, beside the TCP one.
    for line in ("- name: NCCL_IB_HCA", "rdma/rdma_shared_device_a: 1", "add: [IPC_LOCK]"):
        assert re.search(rf"^\s*#\s*{re.escape(line)}", text, flags=re.M), line
