"""The installed wheel: one top-level package, ``ddiloco``, with every module importable from
outside the checkout, and the old top-level names gone.

The wheel is built from a copy of the tracked files and installed with ``--no-deps`` into a new
venv; the third-party dependencies come from this interpreter's site-packages through a path
file (a path added that way is not a site directory, so the checkout's editable install is not
seen there).
"""

from __future__ import annotations

import json
import shutil
import site
import subprocess
import sys
import textwrap
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def _tracked_copy(dest: Path) -> Path:
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.splitlines()
    for rel in files:
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout (the wheel is built from the tracked files)")
    src = _tracked_copy(tmp_path_factory.mktemp("src"))
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (found,) = out.glob("ddiloco-*.whl")
    return found


@pytest.fixture(scope="module")
def clean_venv(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> tuple[Path, Path]:
    """(python, site-packages) of a new venv with only the wheel installed."""
    env_dir = tmp_path_factory.mktemp("venv")
    venv.create(env_dir, with_pip=False, symlinks=True)
    python = env_dir / "bin" / "python"
    site_dir = Path(subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True).stdout.strip())
    (site_dir / "_ddiloco_test_deps.pth").write_text(
        "\n".join(p for p in site.getsitepackages() if Path(p).is_dir()) + "\n")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q",
         str(wheel)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return python, site_dir


def test_the_wheel_holds_only_the_ddiloco_namespace(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        tops = {name.split("/")[0] for name in zf.namelist()}
        names = set(zf.namelist())
    assert {t for t in tops if not t.endswith(".dist-info")} == {"ddiloco"}
    for path in ("ddiloco/pipeline/wire.py", "ddiloco/store/publish.lua",
                 "ddiloco/workers/learner/core.py", "ddiloco/chaos/scripts/gentle.yaml",
                 "ddiloco/workers/configs/ci-tiny.yaml", "ddiloco/workers/configs/default.toml"):
        assert path in names, path
    # configs/ ships its run configs and topologies, not compose's dashboards
    assert not any(n.startswith("ddiloco/workers/configs/grafana") for n in names)


def test_site_packages_top_level_is_ddiloco_alone(clean_venv: tuple[Path, Path]) -> None:
    _, site_dir = clean_venv
    ours = {p.name for p in site_dir.iterdir()} - {"_ddiloco_test_deps.pth", "__pycache__"}
    packages = {n for n in ours if not n.endswith((".dist-info", ".pth"))}
    assert packages == {"ddiloco"}, sorted(ours)


def test_every_module_imports_from_outside_the_checkout(clean_venv: tuple[Path, Path],
                                                        tmp_path: Path) -> None:
    python, site_dir = clean_venv
    code = textwrap.dedent(f"""
        import importlib, json, pkgutil, sys
        import ddiloco
        assert ddiloco.__file__.startswith({str(site_dir)!r}), ddiloco.__file__
        names = sorted(m.name for m in pkgutil.walk_packages(ddiloco.__path__, "ddiloco.")
                       if not m.name.endswith("__main__"))
        failed = {{}}
        for name in names:
            try:
                importlib.import_module(name)
            except Exception as exc:  # report every failure, not the first
                failed[name] = f"{{type(exc).__name__}}: {{exc}}"
        print(json.dumps({{"modules": names, "failed": failed}}))
    """)
    proc = subprocess.run([str(python), "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not result["failed"], result["failed"]
    for expected in ("ddiloco.pipeline.wire", "ddiloco.store.embedded",
    "ddiloco.workers.learner.core",
                     "ddiloco.chaos.runner", "ddiloco.cli"):
        assert expected in result["modules"]


@pytest.mark.parametrize("old", ["pipeline", "store", "workers", "chaos"])
def test_old_top_level_names_are_gone(clean_venv: tuple[Path, Path], tmp_path: Path,
                                      old: str) -> None:
    python, _ = clean_venv
    proc = subprocess.run([str(python), "-c", f"import {old}"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert f"No module named '{old}'" in proc.stderr


@pytest.mark.parametrize("old", ["pipeline", "store", "workers", "chaos"])
def test_old_names_from_the_checkout_fail_with_the_new_name(old: str) -> None:
    """In the checkout the folders are importable by their bare names: that is refused with
    the name to use instead of loading a second copy of the layer."""
    proc = subprocess.run([sys.executable, "-c", f"import {old}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert f"is the package 'ddiloco.{old}': import it by that name" in proc.stderr


def test_bundled_scripts_and_configs_resolve_from_the_installed_package(
        clean_venv: tuple[Path, Path], tmp_path: Path) -> None:
    python, site_dir = clean_venv
    code = textwrap.dedent(f"""
        import json
        from ddiloco.bundled import resolve_chaos_script
        from ddiloco.chaos.script import load_script
        from ddiloco.workers.run.bundled import resolve_config
        from ddiloco.workers.run.config import load_config
        paths = [resolve_chaos_script("gentle"), resolve_config("ci-tiny")]
        assert all(str(p).startswith({str(site_dir)!r}) for p in paths), paths
        print(json.dumps({{"script": load_script(paths[0]).name,
                          "learners": load_config("ci-tiny").run.learners}}))
    """)
    proc = subprocess.run([str(python), "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"script": "gentle",
                                                                "learners": 2}
    cli = python.parent / "ddiloco"
    listed = subprocess.run([str(cli), "chaos", "scripts"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    assert any(line.startswith("gentle ") for line in listed.stdout.splitlines())
    wrong = subprocess.run([str(cli), "chaos", "run", "gentel"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=120)
    assert wrong.returncode == 2
    assert "did you mean 'gentle'?" in wrong.stderr


def test_workers_start_through_their_own_entry_point(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "ddiloco.workers", "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for role in ("learner", "syncer", "evaluator"):
        assert role in proc.stdout
