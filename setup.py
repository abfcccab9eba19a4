"""Build Poseidon: the planning package, the runtime, and the Cython core.

The core is every ``cython_core/*.pyx`` and every ``cython_core/*.py`` other than ``__init__.py``: those are
links to modules of ``poseidon_plugin/search`` written in Cython's pure-Python mode, typed by the
``.pxd`` of the same name beside the link; the same file runs uncompiled under
``POSEIDON_PURE_PYTHON=1`` (one source for both).

Everything installs under the one package ``poseidon_plugin``: the repository's top-level folders
``cython_core/`` and ``patches/`` are reached through the links ``poseidon_plugin/_core`` and
``poseidon_plugin/patches``, so nothing generic lands in site-packages.
"""

import glob
import os
import re

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

try:
    from Cython.Build import cythonize
except ImportError as exc:  # Cython is a build requirement (pyproject.toml); say so plainly
    raise SystemExit("building Poseidon needs Cython: pip install 'Cython>=3.0' (or pip install .)") from exc

HERE = os.path.dirname(os.path.abspath(__file__))
os.chdir(HERE)

SOURCES = sorted(glob.glob("cython_core/*.pyx")) + sorted(
    p for p in glob.glob("cython_core/*.py") if os.path.basename(p) != "__init__.py")
extensions = [
    Extension(f"poseidon_plugin._core.{os.path.splitext(os.path.basename(src))[0]}",
              [os.path.join("poseidon_plugin", "_core", os.path.basename(src))], extra_compile_args=["-O3"])
    for src in SOURCES
]
# the pure-Python-mode sources carry no directive comments: they are set here (the .pyx set their own);
# their annotations are documentation (the .pxd declares the C types) and their locals' C types are inferred
DIRECTIVES = {"language_level": "3", "boundscheck": False, "wraparound": False, "cdivision": True,
              "initializedcheck": False, "auto_pickle": False, "infer_types": True,
              "annotation_typing": False}

# the one version string lives in poseidon_plugin/__init__.py
with open(os.path.join("poseidon_plugin", "__init__.py"), encoding="utf-8") as f:
    VERSION = re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)

# psutil: megatron-core's torch_dist checkpoint writer reads the process memory with it (--save)
CPU_STACK = ["torch==2.13.0", "megatron-core==0.16.1", "psutil>=5.9"]
# megatron.training (Megatron-LM's training loop) imports these; triton's CPU-installable wheel of torch 2.13
MEGATRON_LM_IMPORTS = ["triton==3.9.0", "pydantic>=2", "tqdm>=4", "wrapt>=1.14", "six>=1.16", "regex>=2023",
                       "einops>=0.7"]


class BuildExt(build_ext):
    """The Cython core, then, for an editable or in-place build, the package's bytecode beside its sources.

    A regular install byte-compiles the package into site-packages; an editable one runs the sources where
    they are and leaves the bytecode to the first import, which writes none where ``PYTHONDONTWRITEBYTECODE``
    is set (container images often set it): every ``poseidon`` and ``poseidon-run`` process, and every rank,
    would then compile the package from source (~0.2 s a start on a 2-core machine). A source edited later
    is recompiled on import as usual (the bytecode records the source's size and time)."""

    def run(self):
        super().run()
        if self.inplace or getattr(self, "editable_mode", False):
            import compileall

            # the linked folders (poseidon_plugin/patches, poseidon_plugin/_core) by their own names:
            # compile_dir does not follow links, and their bytecode lands beside the linked sources
            if not all([compileall.compile_dir(folder, quiet=1) for folder in ("poseidon_plugin", "patches",
                                                                              "cython_core")]):
                print("poseidon: some sources could not be byte-compiled; they are compiled on import instead")


setup(
    name="poseidon-plugin",
    version=VERSION,
    description="Heterogeneity-aware parallelism planning and launching for Megatron-LM / MindSpeed-LLM",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["poseidon_plugin", "poseidon_plugin.*"]),
    package_data={"poseidon_plugin": ["specs/presets/*.yaml", "specs/presets/*.json"],
                  "poseidon_plugin._core": ["*.pxd", "*.pyx"]},
    ext_modules=cythonize(extensions, compiler_directives=DIRECTIVES, include_path=[HERE]),
    cmdclass={"build_ext": BuildExt},
    install_requires=["PyYAML>=5.4"],
    extras_require={
        # the CPU stack the distributed tests and the CPU demo run on (pinned: see README)
        "cpu": CPU_STACK,
        # the test extra builds on the cpu one
        # and what importing Megatron-LM's own pretrain_gpt.py needs (tests/dist/test_megatron_lm_client.py)
        "test": [*CPU_STACK, "pytest>=7", "hypothesis>=6", *MEGATRON_LM_IMPORTS],
    },
    entry_points={"console_scripts": [
        "poseidon = poseidon_plugin.cli:main",
        "poseidon-run = poseidon_plugin.runtime.launcher:main",
    ]},
    zip_safe=False,
)
