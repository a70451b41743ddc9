"""Build step: a wheel carries the migrations and the demo's example pages inside ``worker/_bundled/``.

They sit at the top of the checkout (DESIGN.md fixes the layout), outside every package, so a plain
wheel left them out and ``factmill db upgrade`` could not run from one. An editable install (./dev, the
Dockerfile) reads the checkout itself; ``worker.db.resource_root`` picks whichever is there.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

BUNDLED = ("alembic", "alembic.ini", "examples")


class BuildPyWithResources(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        target = Path(self.build_lib) / "worker" / "_bundled"
        for name in BUNDLED:
            source = Path(name)
            if source.is_dir():
                skip = shutil.ignore_patterns("__pycache__", "*.pyc")
                shutil.copytree(source, target / name, ignore=skip, dirs_exist_ok=True)
            elif source.is_file():
                target.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, target / name)
            # Missing (a dependencies-only build, as the Dockerfile's first layer): nothing to carry;
            # worker.db says so plainly if migrations are then asked for.


setup(cmdclass={"build_py": BuildPyWithResources})
