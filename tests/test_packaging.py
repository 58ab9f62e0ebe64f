"""The wheel: built from a copy of the source tree (so stale build/ output cannot leak in), installed with
--no-deps into a fresh venv, imported from outside the repository; it holds exactly the package's
modules, so a subpackage missing from pyproject.toml's list fails here instead of silently missing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

from test_layers import PACKAGE, ROOT, package_modules

def _package_files() -> list[str]:
    """The package's modules as paths inside a wheel (radixlm/core/runtime/engine.py, ...)."""
    return sorted(PACKAGE + "/" + path.relative_to(ROOT).as_posix()
                  for path in package_modules(ROOT, PACKAGE).values())


def _copy_source(dst: Path) -> None:
    """The checkout as git would give it: no venv, no build output."""
    shutil.copytree(ROOT, dst, ignore=shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info", "__pycache__"))


def test_wheel_installs_and_imports_in_a_fresh_venv(tmp_path):
    src = tmp_path / "src"
    _copy_source(src)
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-cache-dir", "-q",
         "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=120)
    assert build.returncode == 0, build.stdout + build.stderr
    assert "warning" not in (build.stdout + build.stderr).lower(), build.stdout + build.stderr
    (wheel,) = (tmp_path / "dist").glob("radixlm-*.whl")

    listed = {n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".py")}
    missing, extra = sorted(set(_package_files()) - listed), sorted(listed - set(_package_files()))
    assert not missing, f"not in the wheel (is the package in pyproject.toml's list?): {missing}"
    assert not extra, f"in the wheel but no module of the package: {extra}"

    # A fresh venv that sees this interpreter's packages (torch, starlette, ...) but not its radixlm:
    # --system-site-packages reaches only the base interpreter, so a .pth adds this venv's site-packages
    # as a plain path (its editable-install hook, itself a .pth, does not run from there).
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "outer_site.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q",
         str(wheel)], capture_output=True, text=True, timeout=120)
    assert install.returncode == 0, install.stdout + install.stderr

    code = ("import radixlm, radixlm.server, radixlm.adapters.native; "
            "print(radixlm.__file__); print(radixlm.Engine.__module__)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    ran = subprocess.run([str(python), "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env,
                         timeout=120)
    assert ran.returncode == 0, ran.stderr
    location, engine_module = ran.stdout.split()
    assert Path(location).is_relative_to(env_dir), location
    assert engine_module == "radixlm.core.runtime.engine"
