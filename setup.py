"""The two build steps pyproject.toml cannot declare (everything else about the package is there).

1. The CRI client stubs (`criuctl_cri`), generated with grpcio-tools (a build requirement, never a
   runtime one) from the CRI `runtime/v1` api.proto that scripts/cri-proto.sh fetches from Debian's
   containerd *source* package into $CRIUCTL_CRI_SRC (the proto is never copied into this
   repository). Generated into build/cri/ and shipped as the package `criuctl_cri`; an editable
   install imports them from there. Without the proto the build goes on without them: the agent then
   sees no containers, and `criuctl doctor` says why (a laptop that only runs `criuctl migrate` needs
   no CRI at all).
2. The hook tree, hooks/ (sitecustomize.py and the `criuctl_hook` package), copied whole into the
   wheel as criuctl's package data, criuctl/hooks/: a workload gets that folder on its PYTHONPATH
   (`criuctl_hook.contract.HOOKS_DIR`), and site-packages, the folder above the importable
   `criuctl_hook`, must never go there. An editable install uses hooks/ itself.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

CRI_SRC = Path(os.environ.get("CRIUCTL_CRI_SRC", "/usr/local/src/criuctl/containerd"))
CRI_PROTO = "criuctl_cri/api.proto"  # relative to CRI_SRC: protoc names the package after this path
CRI_OUT = "build/cri"  # relative to this file, where setuptools wants package folders
HOOKS = "hooks"
HOOKS_IN_WHEEL = ("criuctl", "hooks")


class BuildPy(build_py):
    """build_py, plus the CRI stubs before the packages are copied and the hook tree after."""

    def run(self) -> None:
        if self._generate_cri_stubs():
            if "criuctl_cri" not in self.packages:
                self.packages.append("criuctl_cri")  # the distribution's list: the editable finder reads it
            for mapping in (self.package_dir, self.distribution.package_dir):
                mapping["criuctl_cri"] = f"{CRI_OUT}/criuctl_cri"
        super().run()
        if not self.editable_mode:
            dest = Path(self.build_lib, *HOOKS_IN_WHEEL)
            shutil.rmtree(dest, ignore_errors=True)
            shutil.copytree(HOOKS, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))

    def _generate_cri_stubs(self) -> bool:
        proto = CRI_SRC / CRI_PROTO
        if not proto.is_file():
            print(
                f"criuctl: building without the CRI client stubs: no {proto} (scripts/cri-proto.sh "
                "fetches it; CRIUCTL_CRI_SRC names another folder); the agent will not see containers",
                file=sys.stderr,
            )
            return False
        out = Path(CRI_OUT)
        shutil.rmtree(out / "criuctl_cri", ignore_errors=True)
        (out / "criuctl_cri").mkdir(parents=True)
        argv = [sys.executable, "-m", "grpc_tools.protoc", f"-I{CRI_SRC}", f"--python_out={out}"]
        r = subprocess.run([*argv, f"--grpc_python_out={out}", CRI_PROTO], capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"criuctl: generating the CRI stubs from {proto} failed: {r.stderr.strip()[-500:]}")
        (out / "criuctl_cri" / "__init__.py").write_text('"""The CRI client stubs, made by setup.py."""\n')
        return True


setup(cmdclass={"build_py": BuildPy})
