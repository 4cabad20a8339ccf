"""The launchers in launch/: shellcheck-clean, a Kubernetes manifest that says what it should,
and two torchrun launchers on loopback (`--nnodes 2`) training exactly as one launcher does."""

import glob
import os
import re
import subprocess
import sys

import pytest
import yaml

from tests.conftest import ROOT, logged_losses, tiny_gpt_environment
from tests.distributed import free_port

SCRIPTS = sorted(
    glob.glob(os.path.join(ROOT, "launch", "*.sh"))
    + glob.glob(os.path.join(ROOT, "tests", "slurm", "*.sh"))
    + glob.glob(os.path.join(ROOT, "bench", "*.sh"))
)


def test_shellcheck_passes_on_every_launcher():
    shellcheck = os.path.join(os.path.dirname(sys.executable), "shellcheck")
    assert len(SCRIPTS) >= 4
    result = subprocess.run([shellcheck, "-x", *SCRIPTS], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_pytorchjob_manifest():
    with open(os.path.join(ROOT, "launch", "k8s", "pytorchjob.yaml")) as file:
        job = yaml.safe_load(file)
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert {role: spec["replicas"] for role, spec in replicas.items()} == {"Master": 1, "Worker": 1}
    with open(os.path.join(ROOT, "launch", "k8s", "Dockerfile")) as file:
        dockerfile = file.read()
    (image,) = re.findall(r"docker build .* -t (\S+) \.", dockerfile)
    (workdir,) = re.findall(r"^WORKDIR (\S+)$", dockerfile, re.MULTILINE)
    for spec in replicas.values():
        (container,) = spec["template"]["spec"]["containers"]
        assert container["name"] == "pytorch"  # the training operator requires this name
        assert container["image"] == image
        command = " ".join(container["command"])
        assert "bash launch/torchrun_gpt.sh" in command
        assert "NNODES=$WORLD_SIZE NODE_RANK=$RANK NPROC_PER_NODE=8" in command
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
        assert container["workingDir"] == workdir  # where the image has the repository


def test_two_torchrun_nodes_on_loopback_match_one(shakespeare_data, tmp_path):
    def environment(name: str, **overrides) -> dict[str, str]:
        return tiny_gpt_environment(
            shakespeare_data,
            TRAIN_ITERS=8,
            LOG_INTERVAL=1,
            EVAL_INTERVAL=8,
            TP=2,
            SAVE_DIR=tmp_path / name,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=free_port(),
            **overrides,
        )

    script = os.path.join(ROOT, "launch", "torchrun_gpt.sh")
    single = subprocess.run(
        ["bash", script],
        env=environment("one", NPROC_PER_NODE=4),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert single.returncode == 0, single.stderr[-3000:]
    assert "TP=2, PP=1, DP=2" in single.stdout

    shared = environment("two", NNODES=2, NPROC_PER_NODE=2)
    nodes = [
        subprocess.Popen(
            ["bash", script],
            env=dict(shared, NODE_RANK=str(rank)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=300) for node in nodes]
    for node, (_, stderr) in zip(nodes, outputs):
        assert node.returncode == 0, stderr[-3000:]
    # Rank 0 (node 0) prints the run's summary; the last rank (node 1), as in Megatron-LM, the
    # iteration and validation lines.
    assert "TP=2, PP=1, DP=2" in outputs[0][0]
    one_node = logged_losses(single.stdout)
    assert len(one_node["train"]) == 8 and len(one_node["validation"]) == 1
    assert logged_losses(outputs[1][0]) == one_node


@pytest.mark.parametrize(
    "script, workers",
    [("torchrun_gpt.sh", {"NPROC_PER_NODE": 3}), ("ray_gpt.sh", {"NUM_WORKERS": 3, "USE_GPU": 0})],
)
def test_the_launcher_refuses_a_bad_layout_once_before_spawning(
    shakespeare_data, tmp_path, script, workers
):
    """The launchers check the flags before torchrun or Ray starts a worker: one line, exit
    code 2, no worker failure report, nothing created."""
    environment = tiny_gpt_environment(
        shakespeare_data, TP=3, SAVE_DIR=tmp_path / "ckpt", **workers
    )
    result = subprocess.run(
        ["bash", os.path.join(ROOT, "launch", script)],
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "pretrain_gpt.py: error: --num-attention-heads 4 is not divisible by "
        "--tensor-model-parallel-size 3"
    ]
    assert "ChildFailedError" not in result.stdout + result.stderr
    assert not os.path.exists(tmp_path / "ckpt")


@pytest.mark.parametrize(
    "variables, line",
    [
        ({"NNODES": "two"}, "torchrun_gpt.sh: error: NNODES=two: give a whole number"),
        ({"MASTER_PORT": "-1"}, "torchrun_gpt.sh: error: MASTER_PORT=-1: give a whole number"),
        (
            {"NPROC_PER_NODE": "0"},
            "pretrain_gpt.py: error: WORLD_SIZE '0': the job must have at least one process (a "
            "launcher's NNODES x NPROC_PER_NODE)",
        ),
    ],
    ids=["not-a-number", "negative", "no-processes"],
)
def test_torchrun_launcher_refuses_a_launch_variable_before_spawning(
    shakespeare_data, tmp_path, variables, line
):
    """(before: bash's 'two: unbound variable', torchrun's own traceback, or parse_args'
    ZeroDivisionError)"""
    environment = tiny_gpt_environment(shakespeare_data, SAVE_DIR=tmp_path / "ckpt")
    result = subprocess.run(
        ["bash", os.path.join(ROOT, "launch", "torchrun_gpt.sh")],
        env=environment | variables,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (result.returncode, result.stderr.strip().splitlines()) == (2, [line])
    assert not os.path.exists(tmp_path / "ckpt")


def test_rayjob_manifest():
    """launch/k8s/rayjob.yaml runs launch/ray_gpt.sh on the image the Dockerfile builds, with
    a Ray Train worker per GPU and the checkpoints on a volume every pod mounts."""
    with open(os.path.join(ROOT, "launch", "k8s", "rayjob.yaml")) as file:
        job = yaml.safe_load(file)
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    with open(os.path.join(ROOT, "launch", "k8s", "Dockerfile")) as file:
        dockerfile = file.read()
    (image,) = re.findall(r"docker build .* -t (\S+) \.", dockerfile)
    (workdir,) = re.findall(r"^WORKDIR (\S+)$", dockerfile, re.MULTILINE)
    assert '".[ray]"' in dockerfile  # Ray Train in the image
    assert job["spec"]["entrypoint"] == f"bash {workdir}/launch/ray_gpt.sh"
    cluster = job["spec"]["rayClusterSpec"]
    (head,) = cluster["headGroupSpec"]["template"]["spec"]["containers"]
    env = {item["name"]: item["value"] for item in head["env"]}
    (group,) = cluster["workerGroupSpecs"]
    (worker,) = group["template"]["spec"]["containers"]
    gpus = group["replicas"] * worker["resources"]["limits"]["nvidia.com/gpu"]
    assert (env["NUM_WORKERS"], env["USE_GPU"]) == (str(gpus), "1")
    for container in (head, worker):
        assert container["image"] == image and container["workingDir"] == workdir
        mounts = {mount["mountPath"] for mount in container["volumeMounts"]}
        assert any(env["SAVE_DIR"].startswith(path + "/") for path in mounts), env["SAVE_DIR"]
