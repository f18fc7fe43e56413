"""mindvl-ms: a MindSpore-native framework for training MindVL-style multimodal LLMs."""
import os

from setuptools import find_packages, setup


def reqs(fn):
    with open(os.path.join(os.path.dirname(__file__), fn)) as f:
        return [l.strip() for l in f if l.strip() and not l.startswith(("#", "-r"))]


setup(
    name="mindvl-ms",
    version="0.1.0",
    description="MindSpore-native training, conversion and serving of MindVL-style multimodal LLMs",
    # The YAML configs stay in the repository's top-level configs/ and ship as the package data of
    # mindvl_ms.configs (installed as mindvl_ms/configs/; found by mindvl_ms.config.packaged).
    packages=find_packages(include=["mindvl_ms", "mindvl_ms.*"]) + ["mindvl_ms.configs"],
    package_dir={"mindvl_ms.configs": "configs"},
    # ops/csrc: the C++ CPU kernels, compiled on first use (mindvl_ms/ops/cpu_kernels.py)
    package_data={"mindvl_ms.configs": ["*.yaml", "*/*.yaml"], "mindvl_ms.ops": ["csrc/*.cc"]},
    include_package_data=True,
    python_requires=">=3.9,<3.12",
    install_requires=reqs("requirements.txt"),
    extras_require={"test": ["torch==2.13.0", "transformers==4.57.1", "pytest", "import-linter==2.17", "hypothesis"]},
    entry_points={"console_scripts": ["mindvl=mindvl_ms.cli:main"]},
)
