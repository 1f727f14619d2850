"""Container wrapping, srun lines, recipes and image provenance.

Apptainer cannot run here, so the end-to-end wrapping test uses tests/fake_apptainer/apptainer, a
test double that validates the arguments like the real binary and runs the inner command on the host.
"""

import hashlib
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from snowcat.containers import images
from snowcat.containers.wrap import hetjob_step, image_provenance, role_images, srun_line, stage_command, wrap_command
from snowcat.pipeline import lock as lock_mod
from snowcat.pipeline.errors import UserError
from snowcat.slurm.site import SiteProfile, load_site

FAKE_APPTAINER_DIR = Path(__file__).parent / "fake_apptainer"


@pytest.fixture
def fake_apptainer(monkeypatch, tmp_path):
    log = tmp_path / "apptainer-calls.jsonl"
    monkeypatch.setenv("PATH", f"{FAKE_APPTAINER_DIR}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_APPTAINER_LOG", str(log))
    return log


@pytest.fixture
def no_apptainer(monkeypatch, tmp_path):
    # A PATH with python but no apptainer/singularity.
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "python").symlink_to(sys.executable)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}/usr/bin{os.pathsep}/bin")
    for name in ("apptainer", "singularity"):
        assert not any((Path(d) / name).exists() for d in ("/usr/bin", "/bin")), "real apptainer present"


def test_runtime_none_returns_command_unchanged():
    cmd = ["python", "-m", "snowcat.stages", "/runs/r1", "sft"]
    assert wrap_command(cmd, "none", image="ignored.sif", binds=["/x"], gpu=True, env={"A": "1"}) == cmd


def test_apptainer_command_line():
    cmd = stage_command("/p/runs/r1", "sft")
    out = wrap_command(
        cmd,
        "apptainer",
        image="/p/img/trainer.sif",
        binds=["/p/runs/r1", "/p/data:/data:ro", "/p/runs/r1"],
        gpu=True,
        env={"HF_HUB_OFFLINE": "1", "A_B": "x y"},
    )
    assert out == [
        "apptainer",
        "exec",
        "--nv",
        "--bind",
        "/p/runs/r1",
        "--bind",
        "/p/data:/data:ro",
        "--env",
        "A_B=x y",
        "--env",
        "HF_HUB_OFFLINE=1",
        "/p/img/trainer.sif",
        "python",
        "-P",  # safe-path mode: the working directory cannot shadow an installed package
        "-m",
        "snowcat.stages",
        "/p/runs/r1",
        "sft",
    ]
    assert "--nv" not in wrap_command(cmd, "apptainer", image="i.sif", gpu=False)
    assert wrap_command(["x"], "apptainer", image="i.sif", binds=["."])[3] == os.getcwd()  # relative: made absolute
    assert stage_command("/r", "eval", item=3)[-2:] == ["--item", "3"]


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"runtime": "docker", "image": "i.sif"}, "runtime 'docker'"),
        ({"runtime": "apptainer", "image": None}, "needs an image"),
        ({"runtime": "apptainer", "image": "i.sif", "binds": ["/a:rel"]}, "container path must be absolute"),
        ({"runtime": "apptainer", "image": "i.sif", "binds": ["/a,/b"]}, "bind '/a,/b'"),
        ({"runtime": "apptainer", "image": "i.sif", "binds": ["/a:/b:rx"]}, "ro or rw"),
        ({"runtime": "apptainer", "image": "i.sif", "env": {"1BAD": "x"}}, "env '1BAD'"),
        ({"runtime": "apptainer", "image": "i.sif", "binds": ["$SNOWCAT_UNSET_VAR_X/data"]}, "variable not set"),
    ],
)
def test_bad_container_settings_name_the_culprit(kwargs, words):
    with pytest.raises(UserError, match=words.replace("(", r"\(")):
        wrap_command(["true"], **kwargs)


def test_srun_lines():
    site = SiteProfile(mpi_plugin="pspmix")
    assert srun_line(site, None, ["python", "x.py"]) == ["srun", "--mpi=pspmix", "python", "x.py"]
    assert srun_line(SiteProfile(launcher="ibrun"), None, ["a"]) == ["ibrun", "a"]
    assert srun_line(site, [0, 1], ["a"]) == ["srun", "--mpi=pspmix", "--het-group=0,1", "a"]
    assert srun_line(SiteProfile(), [0, 1], {0: ["a"], 1: ["b", "c"]}) == [
        "srun",
        "--mpi=pmix",
        "--het-group=0",
        "a",
        ":",
        "--het-group=1",
        "b",
        "c",
    ]
    with pytest.raises(UserError, match=r"het group\(s\) \[1\]"):
        srun_line(site, [0, 1], {0: ["a"]})


def test_wrapped_stage_runs_through_fake_apptainer(fake_apptainer, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    image = tmp_path / "trainer.sif"
    image.write_bytes(b"SIF fake image bytes")
    inner = [
        sys.executable,
        "-c",
        "import os, sys; open(os.path.join(sys.argv[1], 'out.txt'), 'w').write("
        "os.environ['SNOWCAT_X'] + ' ' + os.environ['FAKE_APPTAINER_IMAGE'])",
        str(run_dir),
    ]
    cmd = wrap_command(inner, "apptainer", image=image, binds=[str(run_dir)], gpu=True, env={"SNOWCAT_X": "42"})
    subprocess.run(cmd, check=True)
    assert (run_dir / "out.txt").read_text() == f"42 {image}"
    calls = [json.loads(line) for line in fake_apptainer.read_text().splitlines()]
    assert calls[0][:4] == ["exec", "--nv", "--bind", str(run_dir)]

    # The double rejects what the real binary rejects: a missing image, a missing bind source.
    missing = wrap_command(inner, "apptainer", image=tmp_path / "nope.sif", binds=[str(run_dir)])
    proc = subprocess.run(missing, capture_output=True, text=True)
    assert proc.returncode == 255 and "nope.sif" in proc.stderr
    bad_bind = wrap_command(inner, "apptainer", image=image, binds=[str(tmp_path / "absent")])
    assert subprocess.run(bad_bind, capture_output=True).returncode == 255


def test_image_provenance_records_digest_and_labels(fake_apptainer, tmp_path):
    image = tmp_path / "rollout.sif"
    image.write_bytes(b"another fake SIF")
    (tmp_path / "rollout.sif.labels.json").write_text(json.dumps({"org.snowcat.revision": "abc123"}))
    prov = image_provenance(image)
    assert prov["sha256"] == hashlib.sha256(b"another fake SIF").hexdigest()
    assert prov["labels"] == {"org.snowcat.revision": "abc123"}
    with pytest.raises(UserError, match="not found"):
        images.image_digest(tmp_path / "missing.sif")


def test_without_apptainer_errors_are_clear(no_apptainer, tmp_path):
    image = tmp_path / "x.sif"
    image.write_bytes(b"x")
    with pytest.raises(UserError, match="apptainer not found on PATH"):
        images.inspect_labels(image)
    prov = image_provenance(image)
    assert prov["labels"] is None and "apptainer not found" in prov["labels_error"]
    assert len(prov["sha256"]) == 64


@pytest.mark.parametrize("name", ["trainer", "rollout", "rollout-aarch64", "sandbox"])
def test_definitions_parse_and_are_pinned(name):
    path = images.DEFINITIONS / f"{name}.def"
    recipe = images.load_recipe(path)
    assert recipe.install, f"{name}.def has no %post"
    labels = " ".join(recipe.labels)
    assert "org.snowcat.version {{ SNOWCAT_VERSION }}" in labels
    assert "org.snowcat.revision {{ SNOWCAT_REVISION }}" in labels
    base = images.definition_arguments(path)["BASE"]
    repo, _, tag = base.rpartition(":")
    assert repo and tag and tag != "latest" and "/" not in tag, f"{name}.def base {base} is not pinned"
    post = "\n".join(recipe.install).replace("\\\n", " ")
    for line in post.splitlines():
        if "pip install" in line:
            packages = [w for w in line.split("install", 1)[1].split() if not w.startswith(("-", "/"))]
            unpinned = [p for p in packages if "==" not in p]
            assert not unpinned, f"{name}.def: {unpinned} not pinned (torch/vllm come from the base image)"


def test_arch_variants_and_build_args():
    assert images.definition("rollout", "aarch64").name == "rollout-aarch64.def"
    assert images.definition("rollout", "x86_64").name == "rollout.def"
    assert images.definition("trainer", "aarch64").name == "trainer.def"  # NGC tags are multi-arch
    args = images.build_args("aarch64")
    assert args["ARCH"] == "aarch64"
    assert len(args["SNOWCAT_REVISION"]) == 40 or args["SNOWCAT_REVISION"] == "unknown"
    with pytest.raises(UserError, match="arch 'ppc64le'"):
        images.build_args("ppc64le")
    with pytest.raises(UserError, match="no nope.def"):
        images.definition("nope")


def test_dockerfile_converts_to_definition(tmp_path):
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text("FROM python:3.11-slim\nENV FOO=bar\nRUN pip install requests==2.32.3\nLABEL maintainer=me\n")
    out = images.dockerfile_to_def(dockerfile, tmp_path / "user.def")
    text = out.read_text()
    assert "Bootstrap: docker" in text and "From: python:3.11-slim" in text
    assert "pip install requests==2.32.3" in text and "FOO" in text
    # and back: the written .def parses again
    assert images.load_recipe(out).fromHeader == "python:3.11-slim"
    other = tmp_path / "x.yaml"
    other.write_text("a: 1\n")
    with pytest.raises(UserError, match="not a recipe"):
        images.load_recipe(other)


def test_build_templates_labels_then_provenance_reads_them(fake_apptainer, tmp_path):
    out = images.build("trainer", tmp_path / "trainer.sif", arch="x86_64")
    labels = images.inspect_labels(out)
    assert labels["org.snowcat.image"] == "trainer"
    assert labels["org.snowcat.revision"] == images.snowcat_revision() != "{{ SNOWCAT_REVISION }}"
    assert labels["org.snowcat.version"] == images.snowcat_version()
    assert labels["org.snowcat.base"] == images.definition_arguments(images.definition("trainer"))["BASE"]
    assert labels["org.snowcat.arch"] == "x86_64"
    prov = image_provenance(out)
    assert prov["labels"] == labels and prov["sha256"] == images.image_digest(out)
    assert not (tmp_path / ".trainer.sif.tmp").exists()
    build_call = [json.loads(line) for line in fake_apptainer.read_text().splitlines()][0]
    assert build_call[:3] == ["build", "--force", "--fakeroot"]
    assert build_call[-1] == str(images.definition("trainer", "x86_64"))


# ----------------------------------------------------------------------- golden launcher lines

GOLDEN = Path(__file__).parent / "golden"
GOLDEN_SITES = {
    # site: (environment of a user on that site, run dir, image dir)
    "jsc-juwels-booster": (
        {"PROJECT": "/p/project/cjsc", "SCRATCH": "/p/scratch/cjsc"},
        "/p/project/cjsc/alice/snowcat/runs/rl-demo",
        "/p/project/cjsc/images",
        "x86_64",
    ),
    "tacc-vista": (
        {"WORK": "/work/01234/alice/vista", "SCRATCH": "/scratch/01234/alice"},
        "/work/01234/alice/vista/snowcat/runs/rl-demo",
        "/work/01234/alice/vista/images",
        "aarch64",
    ),
}


def render_golden(site_name: str) -> list[str]:
    """The launcher lines of a containerised stage on a site, as the Slurm executor composes them."""

    site = load_site(site_name)
    _, run_dir, image_dir, arch = GOLDEN_SITES[site_name]
    binds = [run_dir, site.scratch, site.project]

    def wrapped(stage, image, gpu=True):
        return wrap_command(
            stage_command(run_dir, stage), site.container_runtime, image=f"{image_dir}/{image}-{arch}.sif", binds=binds, gpu=gpu
        )

    extra = ["--kill-on-bad-exit=1"]
    lines = [
        srun_line(site, [0, 1], wrapped("rl", "trainer"), extra=extra),
        srun_line(site, [0, 1], {0: wrapped("rl", "trainer"), 1: wrapped("rl", "rollout")}, extra=extra),
        srun_line(site, None, wrapped("sft", "trainer"), extra=extra),
    ]
    return [shlex.join(line) for line in lines]


@pytest.mark.parametrize("site_name", sorted(GOLDEN_SITES))
def test_golden_launcher_lines(site_name, monkeypatch):
    env = GOLDEN_SITES[site_name][0]
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    expected = [
        line
        for line in (GOLDEN / f"launch_{site_name}.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert render_golden(site_name) == expected


# ----------------------------------------------------------------------- one MPI in every hetjob image

HETJOB_IMAGES = ["trainer", "rollout", "rollout-aarch64"]  # images whose ranks share one MPI world
MPI_SCRIPT = images.DEFINITIONS / "mpi.sh"


def _section(path: Path, name: str) -> list[str]:
    """The lines of one %section of a .def file."""
    out, inside = [], False
    for line in path.read_text().splitlines():
        if line.startswith("%"):
            inside = line.strip() == f"%{name}"
        elif inside and line.strip():
            out.append(line.strip())
    return out


def _script_vars(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if re.match(r"^[A-Z0-9_]+=", line))


def test_hetjob_images_build_the_same_mpi_and_check_it():
    """Trainer and rollout images both build Open MPI with containers/mpi.sh before anything else,
    pip-install no mpi4py wheel (which brings no MPI library), put that MPI first with the same
    transport settings, and fail the build unless mpi4py and snowcat import."""
    env_mpi = {}
    for name in HETJOB_IMAGES:
        path = images.DEFINITIONS / f"{name}.def"
        post = [line.strip() for line in "\n".join(_section(path, "post")).replace("\\\n", " ").splitlines()]
        runs = [i for i, line in enumerate(post) if line == "sh /opt/snowcat/containers/mpi.sh"]
        pips = [i for i, line in enumerate(post) if "pip install" in line]
        assert runs and runs[0] < min(pips), f"{name}.def: mpi.sh must run before the pip installs"
        assert not any("mpi4py" in post[i] for i in pips), f"{name}.def pip-installs mpi4py (a wheel brings no MPI)"
        check = next(line for line in post if '-c "import' in line)
        assert "from mpi4py import MPI" in check
        imported = [m.strip() for m in check.split("import", 1)[1].split(";")[0].split(",")]
        for module in imported:
            if module.split(".")[0] not in ("torch", "deepspeed", "megatron", "vllm"):
                assert module.startswith("snowcat.") and importlib.util.find_spec(module), f"{name}.def: no module {module}"
        env_mpi[name] = [line for line in _section(path, "environment") if "snowcat-mpi" in line or "OMPI_MCA" in line]
    assert env_mpi["trainer"] and all(lines == env_mpi["trainer"] for lines in env_mpi.values()), env_mpi
    prefix = _script_vars(MPI_SCRIPT.read_text())["PREFIX"]
    assert any(line.startswith(f"export LD_LIBRARY_PATH={prefix}/lib") for line in env_mpi["trainer"])
    assert {"export OMPI_MCA_pml=ob1", "export OMPI_MCA_btl=self,vader,tcp"} <= set(env_mpi["trainer"])


def test_mpi_script_is_pinned_verified_and_built_for_slurm():
    text = MPI_SCRIPT.read_text()
    assert subprocess.run(["sh", "-n", str(MPI_SCRIPT)], capture_output=True).returncode == 0  # parses
    v = _script_vars(text)
    assert re.fullmatch(r"\d+\.\d+\.\d+", v["OMPI_VERSION"]) and re.fullmatch(r"[0-9a-f]{64}", v["OMPI_SHA256"])
    assert "${OMPI_VERSION}" in v["OMPI_URL"] and "sha256sum -c" in text  # the tarball is checked before use
    configure = " ".join(text.split("./configure", 1)[1].split("make", 1)[0].split())
    # srun starts the ranks (PMIx client for --mpi=pmix / pspmix); nothing detected from the base image.
    for flag in ("--with-slurm", "--with-pmix=internal", "--without-ucx", "--without-verbs", "--without-ofi", "--without-cuda"):
        assert flag in configure, flag
    install = next(line for line in text.splitlines() if "pip install" in line)
    assert 'MPICC="$PREFIX/bin/mpicc"' in install and "--no-binary=mpi4py" in install and "mpi4py==${MPI4PY_VERSION}" in install
    assert re.fullmatch(r"\d+\.\d+\.\d+", v["MPI4PY_VERSION"])
    last = [line for line in text.splitlines() if line.strip()][-1]
    assert "MPI.Get_library_version()" in last and "Open MPI v${OMPI_VERSION}" in last  # mpi4py loads this MPI


def test_role_images_and_hetjob_step_render_one_image_per_role(monkeypatch):
    """A hetjob stage's roles in their own images: role_images reads each component's image (else the
    stage's), hetjob_step renders the MPMD step of the golden files; one image gives the plain step."""
    env, run_dir, image_dir, arch = GOLDEN_SITES["jsc-juwels-booster"]
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    site = load_site("jsc-juwels-booster")
    trainer, rollout = f"{image_dir}/trainer-{arch}.sif", f"{image_dir}/rollout-{arch}.sif"
    comps = {"trainer": SimpleNamespace(image=None), "rollout": SimpleNamespace(image=rollout)}
    stage = SimpleNamespace(image=trainer, resources=SimpleNamespace(components=comps))
    assert role_images(stage) == {"trainer": trainer, "rollout": rollout}
    no_field = SimpleNamespace(image=trainer, resources=SimpleNamespace(components={"trainer": object(), "rollout": object()}))
    assert role_images(no_field) == {"trainer": trainer, "rollout": trainer}  # components without an image field

    golden = [
        line
        for line in (GOLDEN / "launch_jsc-juwels-booster.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    binds = [run_dir, site.scratch, site.project]
    args = ["-m", "snowcat.stages", run_dir, "rl"]
    extra = ["--kill-on-bad-exit=1"]
    per_role = hetjob_step(
        site, "apptainer", list(role_images(stage).values()), args, binds=binds, gpus=[True, True], extra=extra
    )
    assert shlex.join(per_role) == golden[1]
    one = hetjob_step(site, "apptainer", [trainer, trainer], args, binds=binds, gpus=[True, True], extra=extra)
    assert shlex.join(one) == golden[0]
    host = hetjob_step(site, "none", [trainer, rollout], args, extra=extra, host_python="/venv/bin/python")
    assert host == ["srun", "--mpi=pspmix", "--het-group=0,1", *extra, "/venv/bin/python", "-P", *args]
    with pytest.raises(UserError, match="2 images but 1 GPU flags"):
        hetjob_step(site, "apptainer", [trainer, rollout], args, gpus=[True])
    # srun is told each component's CPUs per task (Slurm 22.05-23.02 do not pass sbatch's down):
    # one count for both keeps the plain form, two counts make each group say its own
    same = hetjob_step(site, "none", [None, None], args, cpus_per_task=[8, 8], extra=extra, host_python="py")
    assert same == ["srun", "--mpi=pspmix", "--het-group=0,1", "--cpus-per-task=8", *extra, "py", "-P", *args]
    mixed = hetjob_step(site, "none", [None, None], args, cpus_per_task=[48, 4], extra=extra, host_python="py")
    assert shlex.join(mixed) == shlex.join(
        ["srun", "--mpi=pspmix", "--het-group=0", "--cpus-per-task=48", *extra, "py", "-P", *args]
        + [":", "--het-group=1", "--cpus-per-task=4", *extra, "py", "-P", *args]
    )
    with pytest.raises(UserError, match="2 images but 1 CPU counts"):
        hetjob_step(site, "none", [None, None], args, cpus_per_task=[4])


# --- the images install from the locks (containers/locks/, docs/installs.md) ------------------------

IMAGE_PYTHON = "3.12"  # NGC PyTorch and vLLM 25.09 and vllm/vllm-openai ship Python 3.12


def _post_lines(path: Path) -> list[str]:
    return [" ".join(line.split()) for line in "\n".join(_section(path, "post")).replace("\\\n", " ").splitlines()]


@pytest.mark.parametrize(
    "name, arch", [("trainer", "x86_64"), ("trainer", "aarch64"), ("rollout", "x86_64"), ("rollout-aarch64", "aarch64")]
)
def test_gpu_images_install_the_gpu_lock_less_what_their_base_provides(name, arch):
    """Every package an image pip-installs comes hash-checked from the GPU lock for the image's Python
    and arch (snowcat itself aside, with --no-deps), so image and venv hold the same versions."""
    path = images.DEFINITIONS / f"{name}.def"
    post = _post_lines(path)
    exports = [line for line in post if "-m snowcat.pipeline.lock gpu --export /opt/snowcat-lock.txt" in line]
    pips = [line for line in post if "pip install" in line]
    assert len(exports) == 1 and pips, f"{name}.def does not install from the GPU lock"
    assert pips[-1].endswith("pip install --no-cache-dir --no-deps --require-hashes -r /opt/snowcat-lock.txt")
    assert post.index(exports[0]) < post.index(pips[-1])
    assert all(line.endswith("--no-deps /opt/snowcat") for line in pips[:-1]), pips
    args = shlex.split(exports[0].split(" -m ", 1)[1])
    without = args[args.index("--without") + 1 :]
    lock = lock_mod.find_lock("gpu", IMAGE_PYTHON, arch)
    kept = {e.name for e in lock_mod.subset(lock, without=without)}  # every pattern matches a locked package
    assert "mpi4py" not in kept, "mpi4py is built by containers/mpi.sh against the image's Open MPI"
    if name == "trainer":  # torch and its CUDA stack are the NGC base's
        assert {"deepspeed", "megatron-core", "transformers"} <= kept and not kept & {"torch", "triton", "vllm"}
    if name == "rollout":  # the base is the lock's vLLM, with its torch
        assert not kept & {"torch", "triton", "vllm", "deepspeed"} and "transformers" in kept
        assert images.definition_arguments(path)["BASE"] == f"vllm/vllm-openai:v{lock.pins['vllm']}"
    if name == "rollout-aarch64":  # NGC's vLLM is not the lock's: the lock's vLLM and torch go in
        assert {"vllm", "torch", "transformers"} <= kept and "deepspeed" not in kept


def test_mpi4py_built_in_images_is_the_locked_one():
    version = _script_vars(MPI_SCRIPT.read_text())["MPI4PY_VERSION"]
    for path in sorted(lock_mod.LOCKS_DIR.glob("*-py*-*.txt")):
        assert lock_mod.read_lock(path).pins["mpi4py"] == version, path.name


def test_sandbox_image_installs_the_locked_pytest():
    path = images.DEFINITIONS / "sandbox.def"
    assert _section(path, "files") == ["containers/locks/sandbox-py3.11.txt /opt/snowcat-lock.txt"]
    post = _post_lines(path)
    assert [line for line in post if "pip install" in line] == [
        "python -m pip install --no-cache-dir --no-deps --require-hashes -r /opt/snowcat-lock.txt"
    ]
    assert images.definition_arguments(path)["BASE"].startswith("python:3.11-")  # the lock's Python
    assert "pytest" in lock_mod.read_lock(lock_mod.LOCKS_DIR / "sandbox-py3.11.txt").pins
