"""Packaging details pyproject.toml cannot express: the top-level ``configs/`` and ``recipes/``
folders (where users read and edit them in a checkout) ship inside the wheel as the package
data ``diloco_lightning/configs`` and ``diloco_lightning/recipes``: one copy, two places to
find it (``diloco_lightning.app.config._data_dir``)."""

from setuptools import find_packages, setup

DATA = {"diloco_lightning.configs": "configs", "diloco_lightning.recipes": "recipes"}

setup(
    packages=find_packages(include=["diloco_lightning", "diloco_lightning.*"]) + sorted(DATA),
    package_dir=DATA,
    package_data={"diloco_lightning.configs": ["*.yaml", "*/*.yaml"], "diloco_lightning.recipes": ["*.yaml"]},
)
