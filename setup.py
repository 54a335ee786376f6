"""Builds torch_ext._C through CMake + Ninja.

One CMake build tree (build/) compiles the core library once; the Python
extension, the GoogleTest suites and the C++ examples all link that same
libtorch_ext_core.so. This file only drives CMake and copies the two shared
objects into the package.
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
BUILD_DIR = Path(os.environ.get("TORCH_EXT_BUILD_DIR", ROOT / "build"))


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        import torch.utils

        BUILD_DIR.mkdir(parents=True, exist_ok=True)
        jobs = os.environ.get("MAX_JOBS", str(min(os.cpu_count() or 1, 2)))
        if not (BUILD_DIR / "build.ninja").exists():
            subprocess.check_call(
                [
                    "cmake", "-G", "Ninja", str(ROOT),
                    f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
                    f"-DPython3_EXECUTABLE={sys.executable}",
                ],
                cwd=BUILD_DIR,
            )
        subprocess.check_call(["cmake", "--build", ".", "--", f"-j{jobs}"], cwd=BUILD_DIR)
        built = sorted(BUILD_DIR.glob("_C*.so"))
        if not built:
            raise RuntimeError(f"CMake produced no _C extension in {BUILD_DIR}")
        targets = {Path(self.get_ext_fullpath(ext.name)).parent, ROOT / "torch_ext"}
        for dest in targets:
            dest.mkdir(parents=True, exist_ok=True)
            shutil.copy2(built[0], dest / Path(self.get_ext_fullpath(ext.name)).name)
            shutil.copy2(BUILD_DIR / "libtorch_ext_core.so", dest / "libtorch_ext_core.so")


setup(
    name="torch_ext",
    version="0.1.0",
    description="Pure fused training steps, global memory planning and reactive sweeps for PyTorch",
    packages=find_packages(include=["torch_ext", "torch_ext.*"]),
    ext_modules=[CMakeExtension("torch_ext._C")],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.10",
    install_requires=["torch>=2.9", "numpy", "tqdm", "matplotlib", "pandas"],
    entry_points={"console_scripts": ["torch-ext=torch_ext.cli:main"]},
    zip_safe=False,
)
