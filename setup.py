"""Package discovery (everything else is in pyproject.toml).

The model zoo lives in ``models/`` at the top of the repository and installs as
``placement.models``, never as a top-level ``models`` package that would collide with a
user's own ``models`` package or ``models.py``.
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["placement", "placement.*"]), "placement.models"],
    package_dir={"placement.models": "models"},
)
