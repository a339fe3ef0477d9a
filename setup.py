"""Build script: compiles the pybind11 extensions `megatron.data.helpers` (dataset indices)
and `megatron.tokenizer.bpe_engine` (the GPT-2 BPE encoder).

All metadata lives in pyproject.toml. The extensions need only a C++17 compiler and the
Python headers: no Makefile, no python3-config, no CUDA toolkit.
"""

import os
import sys

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

HELP = (
    "\n*** Building the C++ extensions (megatron/data/helpers.cpp, "
    "megatron/tokenizer/bpe_engine.cpp) failed.\n"
    "*** They need a C++17 compiler and the Python development headers, for example:\n"
    "***   Debian/Ubuntu: sudo apt-get install g++ python3-dev\n"
    "***   RHEL/Fedora:   sudo dnf install gcc-c++ python3-devel\n"
    "***   conda:         conda install -c conda-forge cxx-compiler\n"
    "*** then run `pip install -e .` again.\n"
)


class BuildHelpers(build_ext):
    """build_ext that compiles the extensions side by side (one per core, unless `-j` says
    otherwise: 17 s one after the other) and says what is missing when the compiler fails."""

    def finalize_options(self) -> None:
        super().finalize_options()
        if self.parallel is None:
            self.parallel = min(len(self.extensions), os.cpu_count() or 1)

    def run(self) -> None:
        try:
            super().run()
        except Exception:
            print(HELP, file=sys.stderr)
            raise


setup(
    ext_modules=[
        Pybind11Extension(
            "megatron.data.helpers",
            ["megatron/data/helpers.cpp"],
            cxx_std=17,
            extra_compile_args=["-O3"],
        ),
        Pybind11Extension(
            "megatron.tokenizer.bpe_engine",
            ["megatron/tokenizer/bpe_engine.cpp"],
            depends=["megatron/tokenizer/bpe_tables.h"],
            cxx_std=17,
            extra_compile_args=["-O3"],
        ),
    ],
    cmdclass={"build_ext": BuildHelpers},
)
