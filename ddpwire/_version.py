"""The package version: the one place it is written. pyproject.toml reads it
(``[tool.setuptools.dynamic]``) without importing the compiled package."""
__version__ = "0.1.0"
