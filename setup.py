"""Build hook (everything else is in pyproject.toml): generate the gRPC stubs from proto/
before packaging, so that `pip install .` ships them (they are a build product, not in git)."""

import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithStubs(build_py):
    def run(self):
        subprocess.run([sys.executable, str(Path(__file__).resolve().parent / "tools" / "gen_proto.py")], check=True)
        super().run()


setup(cmdclass={"build_py": BuildPyWithStubs})
