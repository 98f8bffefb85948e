"""The EKS train-stage manifests: schema-valid (kubernetes-validate, strict, at the pinned
Kubernetes version), idempotent names, the launch contract the watcher relies on, and the
hardening: every pod the backend renders meets Pod Security "restricted" as the image's
non-root user, and each Job's NetworkPolicy admits only the Job's own pods."""

from __future__ import annotations

import copy
import subprocess
import sys

import kubernetes_validate
import pytest
import yaml

from flows.context import eks_train_config
from flows.models import PipelineParams
from tasks.backends.eks import hydrate, security
from tasks.backends.eks.params import INSTANCE_TYPES, EksParams
from tasks.backends.eks.render import JOB_NAME_LABEL, job_name, labels, render_all
from tests.helpers import REPO, worker_env

# The Kubernetes version the manifests are validated against; deploy/eks/cluster.yaml pins the
# same one.
K8S_VERSION = "1.34"


def params(**kw) -> PipelineParams:
    return PipelineParams(
        **{
            "backend": "eks",
            "nodes": 4,
            "global_batch": 256,
            "workload": "llama3-8b",
            "run_id": "run-2026-11-29",
            **kw,
        }
    )


def render(p: PipelineParams, attempt: int = 1) -> list[dict]:
    return render_all(
        eks_train_config(p, p.run_id or "x"),
        run_id=p.run_id or "x",
        attempt=attempt,
        nodes=p.nodes,
        eks=p.eks,
    )


@pytest.mark.parametrize("attempt", [1, 2])
def test_manifests_validate_strictly(attempt: int):
    for doc in render(params(), attempt):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_schema_catches_a_wrong_field():
    _policy, _svc, _config, job = render(params())
    job["spec"]["template"]["spec"]["containers"][0]["resource"] = {}  # typo'd field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, K8S_VERSION, strict=True)


def test_same_attempt_same_names_next_attempt_new_names():
    a, b, c = render(params(), 1), render(params(), 1), render(params(), 2)
    assert a == b
    assert a[2]["metadata"]["name"] != c[2]["metadata"]["name"]
    long = job_name("x" * 80, 3)
    assert len(long) <= 52 and long.endswith("-a3") and long != job_name("x" * 81, 3)


def test_launch_contract():
    p = params(drills={"faults": ["exception@step=5,rank=3"]})
    _policy, svc, config, job = render(p)
    name = job["metadata"]["name"]
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == 4 and spec["backoffLimit"] == 0
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and pod["subdomain"] == svc["metadata"]["name"] == name
    assert svc["spec"]["clusterIP"] == "None"
    c = pod["containers"][0]
    # NVRx's launcher through the agent, which beats for the node on FSx (trainer.node_beat).
    assert c["command"] == ["python"]
    args = c["args"]
    assert args[:5] == ["-m", "trainer.agent", "--beat", "/fsx/runs/run-2026-11-29:1", "--"]
    assert f"--rdzv-endpoint={name}-0.{name}.nvrx.svc.cluster.local:29500" in args
    assert "--nproc-per-node=8" in args and "--nnodes=4" in args and "--max-restarts=3" in args
    # The workers read the attempt's whole config from the ConfigMap of the Job's name, which
    # the bundle carries and the pod mounts read-only; nothing travels as flags.
    assert args[-3:] == ["-m", "trainer", "--config=/etc/nvrx-pipeline/attempt/train-attempt1.json"]
    cfg = eks_train_config(p, "run-2026-11-29")
    assert config["metadata"]["name"] == name
    assert load_config_text(config["data"]["train-attempt1.json"]) == cfg
    pod = job["spec"]["template"]["spec"]
    assert {"name": "config", "configMap": {"name": name}} in pod["volumes"]
    assert {"name": "config", "mountPath": "/etc/nvrx-pipeline/attempt", "readOnly": True} in c[
        "volumeMounts"
    ]
    assert str(cfg.run_root) == "/fsx/runs/run-2026-11-29" and cfg.device.value == "cuda"
    assert [str(f) for f in cfg.faults] == [
        "exception@step=5,rank=3"
    ] and cfg.workload == "llama3-8b"
    # requests == limits, cpu and memory included: Guaranteed QoS (tests/test_eks_defaults.py)
    assert c["resources"]["limits"] == c["resources"]["requests"]
    assert c["resources"]["limits"] == {
        "cpu": "189",
        "memory": "1934Gi",
        "nvidia.com/gpu": "8",
        "vpc.amazonaws.com/efa": "32",
    }
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert mounts == {"/fsx": "fsx", "/dev/shm": "shm", "/tmp": "tmp", security.HOME: "home",
                      "/etc/nvrx-pipeline/attempt": "config"}  # fmt: skip
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["fsx"]["persistentVolumeClaim"]["claimName"] == "fsx-claim"
    assert vols["shm"]["emptyDir"]["medium"] == "Memory"
    rules = spec["podFailurePolicy"]["rules"]
    assert rules[0]["onExitCodes"]["values"] == [93]
    assert rules[1]["onPodConditions"] == [{"type": "DisruptionTarget", "status": "True"}]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["NVRX_STAGE_ATTEMPT"] == "1" and env["FI_PROVIDER"] == "efa"
    # Node memory (issue 29) lives in the pod's memory-backed /dev/shm: a respawn finds it.
    assert env["NVRX_NODE_MEMORY"].startswith("/dev/shm/")


def test_render_k8s_cli():
    argv = [
        sys.executable,
        "-m",
        "flows.cli",
        "render-k8s",
        "--run-id",
        "cli-run",
        "--set",
        "nodes=2",
        "--set",
        "global_batch=32",
        "--attempt",
        "2",
    ]
    proc = subprocess.run(
        argv, capture_output=True, text=True, env=worker_env(), cwd=REPO, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    docs = list(yaml.safe_load_all(proc.stdout))
    assert [d["kind"] for d in docs] == ["NetworkPolicy", "Service", "ConfigMap", "Job"]
    assert {d["metadata"]["name"] for d in docs} == {"nvrx-cli-run-a2"}
    bad = subprocess.run(
        [*argv[:4], "--set", "global_batch=7"],
        capture_output=True,
        text=True,
        env=worker_env(),
        cwd=REPO,
        timeout=120,
    )
    assert bad.returncode == 2 and "global_batch" in bad.stderr


# --- hardening ------------------------------------------------------------------------------------
RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}


def restricted_violations(pod: dict, *, api_token: bool = False) -> list[str]:
    """What Pod Security "restricted" (Kubernetes 1.34) would refuse in a pod spec, plus our
    own rules: the image's UID/GID, a read-only root filesystem with writable /tmp and HOME,
    and no API token unless the pod calls the API (``api_token``: the flow-run pods)."""
    bad = []
    psc = pod.get("securityContext") or {}
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            bad.append(key)
    for v in pod.get("volumes") or []:
        kinds = set(v) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            bad.append(f"volume {v['name']}: {kinds}")
    if (psc.get("runAsUser"), psc.get("runAsGroup"), psc.get("fsGroup")) != (
        security.UID,
        security.GID,
        security.GID,
    ):
        bad.append(f"pod UID/GID {psc}")
    if not api_token and pod.get("automountServiceAccountToken") is not False:
        bad.append("API token mounted")
    for c in [*pod.get("initContainers", []), *pod["containers"]]:
        sc = c.get("securityContext") or {}
        name = c["name"]
        if sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is not True:
            bad.append(f"{name}: runAsNonRoot")
        if sc.get("runAsUser", psc.get("runAsUser")) in (None, 0):
            bad.append(f"{name}: runAsUser")
        if sc.get("allowPrivilegeEscalation") is not False:
            bad.append(f"{name}: allowPrivilegeEscalation")
        if sc.get("privileged"):
            bad.append(f"{name}: privileged")
        caps = sc.get("capabilities") or {}
        if "ALL" not in caps.get("drop", []) or set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            bad.append(f"{name}: capabilities {caps}")
        seccomp = (sc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            bad.append(f"{name}: seccompProfile {seccomp}")
        if sc.get("readOnlyRootFilesystem") is not True:
            bad.append(f"{name}: readOnlyRootFilesystem")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            bad.append(f"{name}: hostPort")
        writable = {m["mountPath"] for m in c.get("volumeMounts", []) if not m.get("readOnly")}
        if not {"/tmp", security.HOME} <= writable:
            bad.append(f"{name}: no writable /tmp and HOME on a read-only root")
    return bad


def hydration_job() -> dict:
    return hydrate.hydration_job(
        name="nvrx-r1-hydrate",
        eks=EksParams(image="img:1"),
        data_dir="/fsx/datasets/b/p",
        manifest_sha256="ab" * 32,
    )


def test_every_rendered_pod_is_restricted_and_non_root():
    _policy, _svc, _config, train = render(params())
    for job in (train, hydration_job()):
        kubernetes_validate.validate(job, K8S_VERSION, strict=True)
        assert restricted_violations(job["spec"]["template"]["spec"]) == [], job["metadata"]


def test_restricted_check_can_fail():
    _policy, _svc, _config, job = render(params())
    pod = copy.deepcopy(job["spec"]["template"]["spec"])
    pod["containers"][0]["securityContext"]["capabilities"]["add"] = ["IPC_LOCK"]
    pod["securityContext"]["runAsUser"] = 0
    del pod["containers"][0]["securityContext"]["allowPrivilegeEscalation"]
    found = " ".join(restricted_violations(pod))
    assert "capabilities" in found and "UID" in found and "allowPrivilegeEscalation" in found


def test_network_policy_admits_only_the_jobs_own_pods():
    p = params()
    policy, svc, _config, job = render(p)
    kubernetes_validate.validate(policy, K8S_VERSION, strict=True)
    name = job["metadata"]["name"]
    # same name and labels as the Job: applied, found and deleted with it
    assert policy["metadata"] == {**job["metadata"], "name": name}
    assert policy["metadata"]["labels"] == labels("run-2026-11-29", 1)
    own = {"podSelector": {"matchLabels": {JOB_NAME_LABEL: name}}}
    spec = policy["spec"]
    # the pods it protects are the ones the Service (rendezvous DNS) selects: this Job's
    assert spec["podSelector"]["matchLabels"] == svc["spec"]["selector"] == {JOB_NAME_LABEL: name}
    assert spec["policyTypes"] == ["Ingress", "Egress"]
    # ingress: from this Job's pods (every port: rendezvous on rdzv_port, and the
    # TCPStore/in-process/NCCL ports picked at run time); from the monitoring namespace only to
    # rank 0's metrics port (tests/test_metrics.py); nothing from any other namespace or IP block
    assert spec["ingress"][0] == {"from": [own]}
    assert spec["ingress"][1]["ports"] == [{"protocol": "TCP", "port": p.metrics_port}]
    assert len(spec["ingress"]) == 2
    rdzv_port = job["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"]
    assert rdzv_port == p.eks.rdzv_port and "ports" not in spec["ingress"][0]
    # egress: this Job's pods, and DNS (port 53 only) in kube-system
    assert spec["egress"][0] == {"to": [own]}
    dns = spec["egress"][1]
    assert {(q["protocol"], q["port"]) for q in dns["ports"]} == {("UDP", 53), ("TCP", 53)}
    assert dns["to"][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "kube-system"
    }
    assert len(spec["egress"]) == 2
    for rule in [*spec["ingress"], *spec["egress"]]:
        assert all("ipBlock" not in peer for peer in rule["to" if "to" in rule else "from"])


def test_network_policy_schema_catches_a_wrong_field():
    policy, _svc, _config, _job = render(params())
    policy["spec"]["ingress"][0]["from"][0]["podSelectors"] = {}  # typo'd field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(policy, K8S_VERSION, strict=True)


def test_network_policy_is_applied_and_deleted_with_the_job(kube):
    """Through the real client against kmock's emulator: the three objects go in together and
    ``delete_job`` (every path that ends an attempt) removes the policy with the Job."""
    from kubernetes.client import ApiException

    p = params()
    docs = render(p)
    for doc in docs:
        kube.apply(doc)
    name = docs[0]["metadata"]["name"]

    def exists(read) -> bool:
        try:
            read(name, "nvrx", _preload_content=False)
            return True
        except ApiException as e:
            assert e.status == 404
            return False

    reads = (
        kube.networking.read_namespaced_network_policy,
        kube.core.read_namespaced_service,
        kube.batch.read_namespaced_job,
    )
    assert [exists(r) for r in reads] == [True, True, True]
    kube.delete_job("nvrx", name)
    assert [exists(r) for r in reads] == [False, False, False]
    kube.delete_job("nvrx", name)  # idempotent: already gone is fine


def test_job_has_an_active_deadline_beyond_the_flows():
    """The API server ends the Job even when the flow runner that would have stopped it is gone."""
    from tasks.backends.eks.render import JOB_DEADLINE_MARGIN_S

    p = params()
    docs = render_all(
        eks_train_config(p, "x"),
        run_id="x",
        attempt=1,
        nodes=p.nodes,
        eks=p.eks,
        deadline_s=p.train_timeout_s,
    )
    [job] = [d for d in docs if d["kind"] == "Job"]
    assert job["spec"]["activeDeadlineSeconds"] == int(p.train_timeout_s) + JOB_DEADLINE_MARGIN_S
    kubernetes_validate.validate(job, K8S_VERSION, strict=True)


@pytest.mark.parametrize(("nodes", "spares", "nnodes"), [("2:4", 0, "2:4"), (4, 1, "4")])
def test_an_elastic_job(nodes, spares, nnodes):
    """MAX + spares pods, agents admitting the range; a node's disruption is ignored by the Job
    (the in-job layer re-forms, the controller replaces the pod), and index 0's success ends
    it. A fixed-size Job keeps failing on a disruption (tests above)."""
    _policy, _svc, _config, job = render_all(
        eks_train_config(p := params(nodes=nodes, spares=spares), "x"),
        run_id="x",
        attempt=1,
        nodes=p.max_nodes,
        min_nodes=p.node_range.min,
        spares=p.spares,
        eks=p.eks,
    )
    kubernetes_validate.validate(job, K8S_VERSION, strict=True)
    spec = job["spec"]
    assert spec["completions"] == spec["parallelism"] == 4 + spares
    [disruption] = [r for r in spec["podFailurePolicy"]["rules"] if "onPodConditions" in r]
    assert disruption["action"] == "Ignore"
    assert spec["successPolicy"] == {"rules": [{"succeededIndexes": "0", "succeededCount": 1}]}
    container = spec["template"]["spec"]["containers"][0]
    argv = container["command"] + container["args"]
    assert argv[:5] == ["python", "-m", "trainer.agent", "--keep-alive", "1:3"]  # shortened
    assert f"--nnodes={nnodes}" in argv


@pytest.mark.parametrize("itype", sorted(INSTANCE_TYPES))
def test_every_gpu_instance_type_renders_from_the_one_table(itype: str):
    """Issue 28, item 4: GPUs, EFA interfaces, CPU and memory of the training pod all come from
    INSTANCE_TYPES; EFA settings (the resource, its toleration, libfabric's provider) only
    where the type has EFA, device RDMA only where EFA does it; the Job validates strictly."""
    spec = INSTANCE_TYPES[itype]
    p = params(eks={"instance_type": itype, "gpus_per_node": spec.gpus}, global_batch=8 * spec.gpus)
    *_, job = render(p)
    kubernetes_validate.validate(job, K8S_VERSION, strict=True)
    pod = job["spec"]["template"]["spec"]
    [c] = pod["containers"]
    limits = c["resources"]["limits"]
    assert limits == c["resources"]["requests"]  # Guaranteed QoS
    assert limits["nvidia.com/gpu"] == str(spec.gpus)
    assert limits.get("vpc.amazonaws.com/efa") == (str(spec.efa) if spec.efa else None)
    cpu = limits["cpu"]
    assert 0 < (int(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu)) < spec.vcpus
    assert 0 < int(limits["memory"].removesuffix("Gi")) < spec.memory_gib
    env = {e["name"]: e["value"] for e in c["env"]}
    assert (env.get("FI_PROVIDER") == "efa") == (spec.efa > 0)
    assert ("FI_EFA_USE_DEVICE_RDMA" in env) == spec.gpudirect_rdma
    tolerated = {t["key"] for t in pod["tolerations"]}
    assert ("vpc.amazonaws.com/efa" in tolerated) == (spec.efa > 0)
    assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": itype}


def test_efa_follows_the_instance_type_or_the_field():
    assert params().eks.pod_efa() == 32  # p5.48xlarge, every interface
    g5 = params(eks={"instance_type": "g5.48xlarge"}).eks
    assert g5.pod_efa() == 1 and not g5.gpudirect_rdma()
    off = params(eks={"instance_type": "p4d.24xlarge", "efa_per_node": 0}).eks
    *_, job = render(params(eks={"instance_type": "p4d.24xlarge", "efa_per_node": 0}))
    env = {e["name"] for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert off.pod_efa() == 0 and "FI_PROVIDER" not in env
    with pytest.raises(ValueError, match=r"eks.efa_per_node: 32 but g5.48xlarge has 1 EFA"):
        params(eks={"instance_type": "g5.48xlarge", "efa_per_node": 32})
    # a type the table does not know: no EFA unless given (cpu and memory must be given too)
    other = {"instance_type": "p6-b200.48xlarge", "cpu": "180", "memory_gi": 1800}
    assert params(eks=other).eks.pod_efa() == 0
    assert params(eks={**other, "efa_per_node": 8}).eks.pod_efa() == 8


def test_render_k8s_takes_an_elastic_range_with_the_default_batch():
    """`render-k8s` with nodes MIN:MAX and no global_batch: the batch is sized for the largest
    world (it exited 2 before)."""
    from flows.cli import main

    assert main(["render-k8s", "--run-id", "elastic", "--set", "nodes=1:2"]) == 0


def test_render_k8s_is_a_stable_bundle_without_aliases(capsys):
    """Issue 28, item 5 (part): with no --run-id the id is derived from the parameters, so the
    same parameters render the same bundle (what `kubectl apply` takes as unchanged); no YAML
    aliases; every object carries Kubernetes' recommended labels and validates strictly."""
    from flows.cli import main

    outs = []
    for _ in range(2):
        assert main(["render-k8s", "--set", "nodes=2", "--set", "global_batch=32"]) == 0
        outs.append(capsys.readouterr())
    assert outs[0].out == outs[1].out
    assert "derived from the parameters" in outs[0].err
    assert "&id" not in outs[0].out and "*id" not in outs[0].out
    docs = list(yaml.safe_load_all(outs[0].out))
    run = docs[0]["metadata"]["labels"]["app.kubernetes.io/instance"]
    assert run.startswith("rk-")
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        lab = doc["metadata"]["labels"]
        for key in ("name", "instance", "component", "part-of", "managed-by"):
            assert lab[f"app.kubernetes.io/{key}"], (doc["kind"], key)
        assert lab["app.kubernetes.io/instance"] == run
    assert main(["render-k8s", "--set", "nodes=3", "--set", "global_batch=48"]) == 0
    assert capsys.readouterr().out != outs[0].out  # other parameters, another run


def load_config_text(text: str):
    import json

    from trainer.config import TrainConfig

    return TrainConfig.from_dict({k: v for k, v in json.loads(text).items() if k != "format"})


@pytest.mark.parametrize(
    "nodes, memory_interval, eks, shm_gi",
    [
        # llama3-8b's memory saves: 8.03 B x 12 bytes x 5 copies (own 2 generations, a peer
        # node's 2, 1 arriving) / 4 pods = 120.4 GB = 113 GiB, and 16 beside them.
        (4, 1, {}, 129),
        (16, 1, {}, 45),  # 30.1 GB = 29 GiB per pod + 16
        (1, 1, {}, 196),  # one pod: no peer copy, its own 2 generations (192.7 GB = 180 GiB)
        (4, 0, {}, 16),  # no memory saves: what else uses /dev/shm
        (4, 1, {"shm_gi": 64}, 64),  # the field wins
        (2, 1, {"memory_gi": 300}, 150),  # 240.9 GB does not fit: half the pod, preflight says
    ],
)  # fmt: skip
def test_dev_shm_is_sized_from_the_models_memory_saves(nodes, memory_interval, eks, shm_gi):
    """Issue 29, item 5: the pod's memory-backed /dev/shm (node memory) is sized from what the
    memory saves keep in it per pod, through the backend's one code path (launch and
    render-k8s), unless eks.shm_gi says otherwise."""
    from flows.context import launch_request
    from tasks.backends.eks.backend import EksBackend

    p = params(nodes=nodes, memory_interval=memory_interval, global_batch=64 * nodes, eks=eks)
    cfg = eks_train_config(p, "r")
    request = launch_request(p, cfg, run_id="r", attempt=1, invocation="inv0001", epoch=1)
    docs = EksBackend(p.eks, nodes=p.launched_nodes).bundle(request)
    (job,) = [d for d in docs if d["kind"] == "Job"]
    vols = {v["name"]: v for v in job["spec"]["template"]["spec"]["volumes"]}
    assert vols["shm"]["emptyDir"]["sizeLimit"] == f"{shm_gi}Gi"
