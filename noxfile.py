"""Developer and CI sessions for the longboat workspace.

``uv run nox`` runs the default sessions (lint, imports, tests). Every session
installs from the committed ``uv.lock`` with uv, so local runs and CI see the
same versions.

    uv run nox -s tests            # every package's default test run
    uv run nox -s "tests(core)"    # one package ("tests(tools)": the benchmark scripts)
    uv run nox -s build isolation  # wheels + sdists, then each wheel alone
    uv run nox -s gpu              # GPU tests and benchmarks (needs CUDA)
    uv run nox -s faults           # fault injection on every stack -> benchmarks/results/
    uv run nox -s build lerobot_parity  # pi0.5, GR00T, SmolVLA against lerobot 0.6.1
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import nox

nox.options.default_venv_backend = "uv"
nox.options.sessions = ["lint", "imports", "tests"]
nox.options.reuse_existing_virtualenvs = True

ROOT = pathlib.Path(__file__).parent
PACKAGES = {
    "core": "longboat-core",
    "kernels": "longboat-kernels",
    "llm": "longboat-llm",
    "vlm": "longboat-vlm",
    "diffusion": "longboat-diffusion",
    "embodied": "longboat-embodied",
    "xpu-plugin": "longboat-xpu-plugin",
}
TEST_DIRS = {name: ROOT / "packages" / name / "tests" for name in PACKAGES}
TEST_DIRS["tools"] = ROOT / "tools"  # the benchmark scripts at --tiny shapes, the launch tests
DIST = ROOT / "dist"
TEST_ENV = ROOT / ".nox" / "test-env"

# Modules that need an optional extra; the isolation check does not import them.
OPTIONAL_MODULES = {
    "longboat-core": ("longboat.core.megatron",),
    "longboat-embodied": ("longboat.embodied.eval.libero_env",),  # the [libero] extra's gym env
}
# Imports every module of a package (argv[1]) except the prefixes that follow it.
IMPORT_ALL = """
import importlib, pkgutil, sys
root, skip = sys.argv[1], tuple(sys.argv[2:])
pkg = importlib.import_module(root)
names = [m.name for m in pkgutil.walk_packages(pkg.__path__, root + ".")]
names = [n for n in names if not n.startswith(skip)] if skip else names
for name in names:
    importlib.import_module(name)
print(f"imported {root} and {len(names)} submodules")
"""


def _sync(session: nox.Session, *args: str) -> None:
    """Install the locked workspace environment into the session's venv."""
    session.run_install(
        "uv",
        "sync",
        "--frozen",
        "--inexact",
        *args,
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
    )


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole tree."""
    _sync(session, "--only-group", "lint")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def imports(session: nox.Session) -> None:
    """import-linter: the package boundaries of docs/ARCHITECTURE.md."""
    _sync(session)
    session.run("lint-imports")


def _test_env(session: nox.Session) -> pathlib.Path:
    """The locked env every test session shares, with bytecode compiled once.

    Test runs start many Python processes (multi-process workers, CLI and kill
    tests); with compiled bytecode each one imports torch / megatron in a
    fraction of the time, and sharing the env compiles it only once.
    """
    session.run(
        "uv",
        "sync",
        "--frozen",
        "--inexact",
        "--compile-bytecode",
        # The interpreter running nox (the workspace's Python) builds the shared env.
        env={
            "UV_PROJECT_ENVIRONMENT": str(TEST_ENV),
            "UV_PYTHON": sys.executable,
            "VIRTUAL_ENV": str(TEST_ENV),
        },
        external=True,
    )
    return TEST_ENV / "bin"


@nox.session(venv_backend="none")
@nox.parametrize("package", list(TEST_DIRS), ids=list(TEST_DIRS))
def tests(session: nox.Session, package: str) -> None:
    """One package's default test run (no slow or GPU tests; tools: tools/*/tests)."""
    bin_dir = _test_env(session)
    tests_dir = TEST_DIRS[package]
    args = session.posargs or ["-m", "not slow and not gpu", "--durations=8"]
    session.run(
        str(bin_dir / "pytest"),
        str(tests_dir),
        *args,
        env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")},
        success_codes=[0, 5],  # 5: a package with no tests yet collected nothing
        external=True,
    )


@nox.session(venv_backend="none")
def slow(session: nox.Session) -> None:
    """The slow tests of every package and tool (world size 4, two simulated nodes, long runs)."""
    bin_dir = _test_env(session)
    session.run(
        str(bin_dir / "pytest"),
        "packages",
        "tools",
        "-m",
        "slow and not gpu",
        *session.posargs,
        external=True,
    )


@nox.session(venv_backend="none")
def faults(session: nox.Session) -> None:
    """The fault-injection suite (tools/faults) on every stack: rank death, hang and error
    in two-process gloo runs, SIGKILL mid-save, Ctrl-C, a corrupt latest checkpoint, a full
    disk; each restart must continue the uninterrupted run's losses exactly. Writes the
    summary table to benchmarks/results/faults_<date>.md."""
    import datetime

    bin_dir = _test_env(session)
    day = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    report = ROOT / "benchmarks" / "results" / f"faults_{day}.md"
    session.run(
        str(bin_dir / "pytest"),
        str(ROOT / "tools" / "faults" / "tests"),
        "-m",
        "faults",
        *session.posargs,
        env={
            "LONGBOAT_FAULTS_REPORT": str(report),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
        },
        external=True,
    )
    session.log(f"summary table: {report}")


@nox.session(venv_backend="none")
def gpu(session: nox.Session) -> None:
    """GPU tests; skipped with a message on machines without CUDA."""
    bin_dir = _test_env(session)
    probe = "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"
    if subprocess.run([str(bin_dir / "python"), "-c", probe], check=False).returncode != 0:
        session.skip("no CUDA device on this machine")
    session.run(
        str(bin_dir / "pytest"), "packages", "tools", "-m", "gpu", *session.posargs, external=True
    )


@nox.session
def build(session: nox.Session) -> None:
    """Wheel + sdist for every package into dist/."""
    shutil.rmtree(DIST, ignore_errors=True)
    for dist_name in PACKAGES.values():
        session.run("uv", "build", "--package", dist_name, "--out-dir", str(DIST), external=True)


def _isolation_check(session: nox.Session, dist_name: str, wheel: pathlib.Path) -> None:
    """Install one wheel (plus its declared deps) alone in a fresh venv and import it."""
    module = {
        "longboat-core": "longboat.core",
        "longboat-kernels": "longboat.kernels",
        "longboat-llm": "longboat.llm",
        "longboat-vlm": "longboat.vlm",
        "longboat-diffusion": "longboat.diffusion",
        "longboat-embodied": "longboat.embodied",
        "longboat-xpu-plugin": "longboat.xpu",
    }[dist_name]
    with tempfile.TemporaryDirectory(prefix=f"iso-{dist_name}-") as tmp:
        venv = pathlib.Path(tmp) / "venv"
        session.run("uv", "venv", "--quiet", "-p", sys.executable, str(venv), external=True)
        py = str(venv / "bin" / "python")
        # Siblings come from dist/ (find-links), everything else from the index. uv caches
        # find-links wheels by file name as if immutable, so a wheel of an earlier build with
        # the same version would be reused: refresh every sibling so the fresh build is used.
        refresh = [arg for name in PACKAGES.values() for arg in ("--refresh-package", name)]
        session.run(
            "uv", "pip", "install", "--quiet", "-p", py, "--find-links", str(DIST), *refresh,
            str(wheel), external=True,
        )  # fmt: skip
        session.run(
            py, "-c", IMPORT_ALL, module, *OPTIONAL_MODULES.get(dist_name, ()), external=True
        )
        listing = session.run(
            "uv", "pip", "list", "--quiet", "-p", py, "--format", "json", external=True, silent=True
        )
        installed = {row["name"].lower() for row in json.loads(listing)}
        session.log(f"{dist_name}: {len(installed)} distributions installed")
        if dist_name == "longboat-embodied":
            for forbidden in ("megatron-core", "transformer-engine"):
                if forbidden in installed:
                    session.error(f"installing longboat-embodied pulled {forbidden}")
        if (
            dist_name not in ("longboat-llm", "longboat-vlm", "longboat-diffusion")
            and "megatron-core" in installed
        ):
            session.error(f"installing {dist_name} pulled megatron-core")


def _stub_wheel(
    folder: pathlib.Path, name: str, version: str, requires: list[str] | None = None
) -> pathlib.Path:
    """A minimal wheel that installs the distribution ``name`` at ``version``: the resolver sees
    that version installed without the real build being fetched (the CPU-install check only asks
    what else an install would change)."""
    import base64
    import hashlib
    import zipfile

    info = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": f"__version__ = {version!r}\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        + "".join(f"Requires-Dist: {r}\n" for r in requires or ()),
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: noxfile\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    records = []
    with zipfile.ZipFile(wheel, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
            digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
            records.append(f"{path},sha256={digest.decode()},{len(text)}")
        z.writestr(f"{info}/RECORD", "\n".join([*records, f"{info}/RECORD,,"]) + "\n")
    return wheel


@nox.session
def cpu_install(session: nox.Session) -> None:
    """The CPU-only install path of the READMEs: with a CPU build of torch installed first
    and its torchvision first (``pip install torch torchvision --index-url
    https://download.pytorch.org/whl/cpu``), installing the stacks keeps both (no CUDA torch,
    no nvidia-* wheels). Resolves against the package index with stand-ins ``torch
    2.11.0+cpu`` and ``torchvision 0.26.0+cpu`` (the pair PyTorch releases together)."""
    if not DIST.exists():
        session.error("dist/ is empty: run `nox -s build cpu_install`")
    wheels = [sorted(DIST.glob(f"{d.replace('-', '_')}-*.whl"))[-1] for d in PACKAGES.values()]
    with tempfile.TemporaryDirectory(prefix="cpu-install-") as tmp:
        venv = pathlib.Path(tmp) / "venv"
        session.run("uv", "venv", "--quiet", "-p", sys.executable, str(venv), external=True)
        py = str(venv / "bin" / "python")
        cpu_builds = [
            _stub_wheel(pathlib.Path(tmp), "torch", "2.11.0+cpu"),
            _stub_wheel(pathlib.Path(tmp), "torchvision", "0.26.0+cpu", requires=["torch==2.11.0"]),
        ]
        session.run(
            "uv", "pip", "install", "--quiet", "-p", py, *map(str, cpu_builds), external=True
        )
        plan = session.run(
            "uv", "pip", "install", "--dry-run", "-p", py, "--find-links", str(DIST),
            *[str(w) for w in wheels], external=True, silent=True,
        )  # fmt: skip
        planned = [line.split()[1] for line in str(plan).splitlines() if line[:3] in (" + ", " - ")]
        kept = ("torch", "torchvision")
        bad = [p for p in planned if p.split("=")[0].split("@")[0] in kept or "nvidia" in p]
        if bad:
            session.error(f"installing the stacks next to a CPU torch would change it: {bad}")
        session.log(f"a CPU torch stays: {len(planned)} other distributions would be installed")


LEROBOT_PIN = "lerobot[pi,groot,smolvla]==0.6.1"
LEROBOT_TESTS = ROOT / "packages" / "embodied" / "tests" / "lerobot_parity"


@nox.session(venv_backend="none")
def lerobot_parity(session: nox.Session) -> None:
    """pi0.5, GR00T and SmolVLA against LeRobot's own implementations (not a default session).
    lerobot 0.6.1 pins torch<2.12, numpy<2.3 and transformers<5.6, so it cannot join the
    workspace lock: a fresh venv gets lerobot[pi,groot,smolvla]==0.6.1 (groot: diffusers,
    peft, dm-tree, timm, decord; no flash-attn; smolvla: num2words, accelerate) with its pins
    (torch 2.11 from the package index, a large first download) and the built longboat-core / -kernels / -embodied wheels from
    dist/ (`nox -s build lerobot_parity`), then runs tests/lerobot_parity on the CPU."""
    stems = ("longboat_core", "longboat_kernels", "longboat_embodied")
    wheels = [sorted(DIST.glob(f"{stem}-*.whl")) for stem in stems]
    if not all(wheels):
        session.error("dist/ has no longboat wheels: run `nox -s build lerobot_parity`")
    with tempfile.TemporaryDirectory(prefix="lerobot-parity-") as tmp:
        venv = pathlib.Path(tmp) / "venv"
        session.run("uv", "venv", "--quiet", "-p", sys.executable, str(venv), external=True)
        py = str(venv / "bin" / "python")
        # One resolution: lerobot's pins win where the wheels' ranges allow (they do today:
        # the wheels ask torch>=2.6, numpy>=1.26); the wheels come from dist/, not the index.
        session.run(
            "uv", "pip", "install", "--quiet", "-p", py, "--find-links", str(DIST),
            LEROBOT_PIN, *[str(w[-1]) for w in wheels], "pytest", "pytest-timeout",
            external=True,
        )  # fmt: skip
        session.run(
            py, "-c", "import lerobot, torch, transformers; print('lerobot', "
            "lerobot.__version__, 'torch', torch.__version__, 'transformers', "
            "transformers.__version__)", external=True,
        )  # fmt: skip
        # From a scratch directory, so the tests import the installed wheels, not the tree.
        session.chdir(tmp)
        session.run(
            py, "-m", "pytest", str(LEROBOT_TESTS), "-q", "-p", "no:cacheprovider",
            "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(ROOT), *session.posargs,
            env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"), "HF_HUB_OFFLINE": "1"},
            external=True,
        )  # fmt: skip


@nox.session
def isolation(session: nox.Session) -> None:
    """Each built wheel alone, with only its declared dependencies, in a fresh venv."""
    if not DIST.exists():
        session.notify("build")
        session.error("dist/ is empty: run `nox -s build isolation`")
    for dist_name in PACKAGES.values():
        stem = dist_name.replace("-", "_")
        wheels = sorted(DIST.glob(f"{stem}-*.whl"))
        if not wheels:
            session.error(f"no wheel for {dist_name} in {DIST}")
        _isolation_check(session, dist_name, wheels[-1])
