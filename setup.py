"""Packaging for megapack. Tool settings (ruff, mypy, pytest) live in pyproject.toml."""

from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="megapack",
    version="0.1.0",
    description="Packed-sequence (THD) batches for Megatron-style tp x pp training that never hang.",
    long_description=(Path(__file__).parent / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",  # the code uses BaseException.add_note (3.11+); CI runs 3.11 and 3.12
    packages=find_packages(include=["megapack", "megapack.*"]),
    package_data={"megapack.bench": ["data/*.json", "data/*.md"]},
    # megatron-core: from the lowest release CI tests (0.16.1, Python 3.11) to the highest it runs
    # (0.19.2, Python 3.12; 0.17 onwards need Python >= 3.12): megapack.core.megatron_release
    install_requires=["torch>=2.4", "numpy>=1.24", "megatron-core>=0.16.1,<=0.19.2"],
    extras_require={
        "test": [
            # the two lines CI runs, one per Python (scripts/test.sh; PYTHON=python3.12 for 0.19.2)
            'megatron-core==0.16.1; python_version < "3.12"',
            'megatron-core==0.19.2; python_version >= "3.12"',
            "pytest>=8",
            "pytest-timeout>=2.3",
            "hypothesis>=6",
            "ruff>=0.6",
            "mypy>=1.10",
            "tokenizers>=0.15",
            "matplotlib>=3.7",
            "transformers>=4.51",
            "jinja2>=3.1",
            "pyarrow>=14",
            "tqdm>=4.60",
            "nvidia-cudnn-frontend==1.28.0",  # the cudnn backend's graphs are described on CPU too
        ],
        "hf": ["transformers>=4.51", "jinja2>=3.1", "tokenizers>=0.15"],
        "arrow": ["pyarrow>=14"],
        "tokenizers": ["tokenizers>=0.15"],
        "plots": ["matplotlib>=3.7"],
        "flash": ["flash-attn>=2.6"],
        "te": ["transformer-engine[pytorch]>=1.13"],
        # cuDNN's ragged THD attention (backend "cudnn"); 1.28.0 is the newest release without
        # required dependencies (1.30+ require nvidia-cutlass-dsl, a 92 MB wheel)
        "cudnn": ["nvidia-cudnn-frontend==1.28.0"],
    },
    entry_points={"console_scripts": ["megapack=megapack.cli:main"]},
)
