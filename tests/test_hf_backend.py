"""HF backend beyond the Llama basics: Qwen2 and Llama built in the test with locally built
tokenizers (char-level WordLevel, byte-level BPE trained here), behaviour log-probs against the trainer's
recompute, chunked log-probs (same numbers and gradients, bounded memory), gradient checkpointing,
model.dtype, and chat-template prompts and tool turns."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from producers.agent import GenerationSettings, run_agent_loop  # noqa: E402
from producers.rollout import generation_request  # noqa: E402
from producers.worker import swap_check_bound  # noqa: E402
from rollstream.config import ConfigError, load_config  # noqa: E402
from rollstream.model import (  # noqa: E402
    CharTokenizer,
    Completion,
    PromptGroups,
    build_batch,
    build_policy,  # noqa: E402
)
from rollstream.model.base import common_prefix_len, resolve_dtype  # noqa: E402
from rollstream.model.chat import encode_prompt, encode_tool_result, render_tool_turn  # noqa: E402
from rollstream.model.hf import HFPolicy, HFTokenizer  # noqa: E402
from rollstream.tasks import ArithToolTask, Prompt, calculate  # noqa: E402
from rollstream.testing.hf_tiny import (
    build_tokenizer,  # noqa: E402
    make_tiny_hf_model,  # noqa: E402
)

ROOT = Path(__file__).resolve().parents[1]
MODELS = {
    "llama-char": dict(arch="llama", tokenizer="char"),
    "qwen2-bpe-chat": dict(arch="qwen2", tokenizer="bpe", chat_template=True),
}
PROMPTS = ["12*34+5=?", "  1234>", "7", "(3*4)-5=?"]


class FixedVersion:
    """A VersionSource that never changes (an agent loop without a bus)."""

    def __init__(self, version: int) -> None:
        self.version = version

    def refresh(self) -> bool:
        """Never loads anything."""
        return False


@pytest.fixture(scope="module", params=sorted(MODELS))
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random HF model + tokenizer on disk, one per architecture."""
    return make_tiny_hf_model(tmp_path_factory.mktemp(request.param), seed=0, **MODELS[request.param])  # type: ignore[arg-type]


def load(path: Path, chunk: int = 0) -> HFPolicy:
    """The model on CPU in float32, with `chunk` tokens per log-prob chunk."""
    policy = HFPolicy.from_pretrained(path, device="cpu")
    policy.logprob_chunk_size = chunk
    return policy


def sampled(
    policy: HFPolicy, temperature: float
) -> tuple[list[Completion], torch.Tensor, torch.Tensor, int, PromptGroups]:
    """Prompts (chat-rendered when the tokenizer has a template) x 6 samples, and their trainer batch with
    its prompt groups (each prompt's 6 rows, as the trainer passes them); responses cut to different lengths
    (a prefix keeps its log-probs) so the batch is padded on both sides."""
    prompts = [encode_prompt(policy.tokenizer, p) for p in PROMPTS]
    trajs = policy.generate(prompts, n=6, max_new_tokens=12, temperature=temperature,
                            generator=torch.Generator().manual_seed(0))
    for i, t in enumerate(trajs):
        keep = max(1, len(t.response_ids) - i % 5)
        t.response_ids, t.log_probs = t.response_ids[:keep], t.log_probs[:keep]
    ids, mask, R = build_batch(
        [t.prompt_ids for t in trajs], [t.response_ids for t in trajs], policy.tokenizer.pad_id
    )
    return trajs, ids, mask, R, PromptGroups.from_labels([i // 6 for i in range(len(trajs))],
                                                         common_prefix_len(prompts))


@pytest.mark.parametrize("temperature", [0.5, 2.0])
@pytest.mark.parametrize("chunk", [0, 7])
def test_behaviour_log_probs_equal_the_trainers_recompute(
    model_dir: Path, temperature: float, chunk: int
) -> None:
    """The HF twin of the tiny model's test: stored log-probs are those of softmax(logits / T), and the
    trainer's recompute (KV-cache-free, left-padded batch, chunked or not) gives them within 1e-5."""
    policy = load(model_dir, chunk)
    trajs, ids, mask, R, groups = sampled(policy, temperature)
    # padding both sides
    assert len({len(t.prompt_ids) for t in trajs}) > 1 and len({len(t.response_ids) for t in trajs}) > 1
    with torch.no_grad():
        at_t = policy.log_probs(ids, mask, R, temperature=temperature, groups=groups)
        at_1 = policy.log_probs(ids, mask, R, groups=groups)
    err = max(abs(at_t[i, j].item() - lp) for i, t in enumerate(trajs) for j, lp in enumerate(t.log_probs))
    off = max(abs(at_1[i, j].item() - lp) for i, t in enumerate(trajs) for j, lp in enumerate(t.log_probs))
    assert err < 1e-5
    assert off > 1e-2  # a temperature-1 recompute would be wrong: the test can tell the two apart


def _logprobs_and_grads(
    policy: HFPolicy, ids: torch.Tensor, mask: torch.Tensor, R: int, groups: PromptGroups
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    policy.module.zero_grad(set_to_none=True)
    policy.train()
    logp, ent = policy.forward_logprobs_entropy(ids, mask, R, temperature=0.8, groups=groups)
    ((logp * mask[:, -R:]).sum() + 0.1 * ent.sum()).backward()
    return logp.detach(), ent.detach(), [p.grad.clone() for p in policy.parameters()]  # type: ignore[union-attr]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_chunked_log_probs_and_gradient_checkpointing_change_no_number(
    model_dir: Path, checkpointing: bool
) -> None:
    base = load(model_dir, chunk=0)
    _, ids, mask, R, groups = sampled(base, 1.0)
    want = _logprobs_and_grads(base, ids, mask, R, groups)
    other = load(model_dir, chunk=5)  # 5 tokens per chunk: many chunks, a ragged last one
    if checkpointing:
        other.enable_gradient_checkpointing()
    got = _logprobs_and_grads(other, ids, mask, R, groups)
    assert other._head_checked is True  # the hidden-state path was taken, not the full-logits fallback
    assert torch.allclose(got[0], want[0], atol=1e-5) and torch.allclose(got[1], want[1], atol=1e-5)
    assert all(torch.allclose(g, w, atol=1e-5) for g, w in zip(got[2], want[2], strict=True))
    assert any(float(w.abs().max()) > 0 for w in want[2])


PEAK = textwrap.dedent("""
    import sys, torch
    from rollstream.model.logprobs import chunked_logprobs_entropy, head_logprobs_entropy
    N, H, V, chunk = int(sys.argv[1]), 64, 8192, int(sys.argv[2])
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, N, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g, requires_grad=True)
    labels = torch.randint(0, V, (1, N), generator=g)
    def rss(field):
        return int(next(l for l in open("/proc/self/status") if l.startswith(field)).split()[1]) * 1024
    # warm the kernels
    head_logprobs_entropy(hidden[0, :4].detach(), weight.detach(), None, labels[0, :4], 1.0)
    open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
    before = rss("VmRSS:")
    if chunk:
        logp, ent = chunked_logprobs_entropy(hidden, weight, None, labels, 1.0, chunk)
    else:
        logp, ent = head_logprobs_entropy(hidden[0], weight, None, labels[0], 1.0)
    (logp.sum() + ent.sum()).backward()
    print(rss("VmHWM:") - before)
""")


def test_chunked_log_probs_peak_memory_does_not_grow_with_tokens_times_vocab() -> None:
    """Forward + backward over N tokens x 8192 vocab. Unchunked, the peak grows with N (the full logits of
    4096 tokens alone are 128 MiB, and log-softmax, exp and autograd keep several such); in chunks of 256
    tokens, 8x the tokens (whose full logits would be 256 MiB) add almost nothing. glibc is told to mmap
    every allocation over 64 KiB, so freed tensors leave the RSS and its peak tracks live memory."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc to read the peak RSS")

    def peak(tokens: int, chunk: int) -> int:
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
        out = subprocess.run(
            [sys.executable, "-c", PEAK, str(tokens), str(chunk)],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
            env=env,
            check=True,
        )
        return int(out.stdout.strip().splitlines()[-1])

    full, full_short = peak(4096, 0), peak(1024, 0)
    short, long = peak(1024, 256), peak(8192, 256)
    logits_4096 = 4096 * 8192 * 4
    print(f"\npeak extra RSS: unchunked 1024 tokens {full_short >> 20} MiB, 4096 tokens {full >> 20} MiB; "
          f"chunked 1024 tokens {short >> 20} MiB, 8192 tokens {long >> 20} MiB")
    # Growths, not absolute peaks: the first backward allocates a fixed ~150-200 MiB (autograd and thread
    # buffers) whatever the token count, which would blur a ratio of peaks.
    assert full - full_short > logits_4096  # unchunked: 3072 more tokens cost more than their full logits
    # chunked: 7168 more tokens cost < 32 MiB (their full logits: 224 MiB)
    assert long - short < logits_4096 / 4
    assert long - short < (full - full_short) / 8


def test_dtype_and_checkpointing_knobs_and_their_errors(tmp_path: Path) -> None:
    model = make_tiny_hf_model(tmp_path / "m", arch="qwen2")
    hf = ["model.backend=hf", f"model.hf_path={model}", "run.device=cpu"]
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert next(build_policy(load_config(None, hf)).parameters()).dtype == torch.float32
    bf16 = build_policy(load_config(None, [*hf, "model.dtype=bfloat16"]))
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    ids, mask, R = build_batch([[1, 5, 6, 7], [1, 8]], [[9, 10, 2], [11]], 0)
    assert bf16.log_probs(ids, mask, R).dtype == torch.float32  # scored in float32 whatever the weights
    # model.autocast: float32 master weights, forward passes in bfloat16 (log-probs still float32)
    fp32 = build_policy(load_config(None, hf))
    ac = build_policy(load_config(None, [*hf, "model.autocast=bfloat16"]))
    with torch.no_grad():
        lp_fp32, lp_ac = fp32.log_probs(ids, mask, R), ac.log_probs(ids, mask, R)
    assert lp_ac.dtype == torch.float32 and 0 < float((lp_ac - lp_fp32).abs().max()) < 5e-2
    ac.forward_logprobs_entropy(ids, mask, R)[0].sum().backward()
    assert {p.dtype for p in ac.parameters()} == {p.grad.dtype for p in ac.parameters()} == {torch.float32}
    greedy = [c.response_ids for c in ac.generate([[1, 5, 6], [1, 8]], n=1, max_new_tokens=4, greedy=True)]
    assert all(len(r) >= 1 for r in greedy)  # generation runs under autocast too
    # rollout.dtype: the producer's own copy in bfloat16 computes in it (no autocast), takes float32 weights,
    # and the swap check allows bfloat16's difference
    rcfg = load_config(None, [*hf, "model.autocast=bfloat16", "rollout.dtype=bfloat16"])
    engine = build_policy(rcfg, dtype=rcfg.rollout.dtype)
    assert {p.dtype for p in engine.parameters()} == {torch.bfloat16} and engine.autocast_dtype is None
    engine.load_state_dict_bytes(fp32.state_dict_bytes())
    with torch.no_grad():
        assert 0 < float((engine.log_probs(ids, mask, R) - lp_fp32).abs().max()) < 5e-2
    engine_dtype = str(next(engine.parameters()).dtype).removeprefix("torch.")  # as the producer reads it
    assert swap_check_bound(load_config(None, [*hf, "rollout.dtype=bfloat16"]), engine_dtype) == 0.15
    assert swap_check_bound(load_config(None, hf), "float32") == 1e-3
    tiny_bf16 = build_policy(load_config(None, ["run.device=cpu", "model.dtype=bfloat16"]))
    assert {p.dtype for p in tiny_bf16.parameters()} == {torch.bfloat16}
    for bad, field in [
        ("model.dtype=fp8", "model.dtype"),
        ("model.autocast=float32", "model.autocast"),
        ("rollout.dtype=auto", "rollout.dtype"),
        ("actor.micro_batch_size=-1", "actor.micro_batch_size"),
        ("actor.logprob_chunk_size=-5", "actor.logprob_chunk_size"),
    ]:
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            load_config(None, [bad])
    with pytest.raises(ConfigError, match=r"actor\.gradient_checkpointing=true needs model\.backend=hf"):
        load_config(None, ["actor.gradient_checkpointing=true"])
    load_config(None, [*hf, "actor.gradient_checkpointing=true"])  # fine with the HF backend


# ---- chat templates ------------------------------------------------------------------------------


def test_prompts_are_rendered_with_the_chat_template_when_there_is_one() -> None:
    chat = HFTokenizer(build_tokenizer("char", chat_template=True))
    ids = encode_prompt(chat, "12+3=?")
    assert chat.decode(ids, skip_special=False) == "<bos><|user|>12+3=?<eos><|assistant|>"
    assert chat.decode(ids) == "12+3=?"
    # model.chat_template=false
    plain = HFTokenizer(build_tokenizer("char", chat_template=True), chat_template=False)
    assert encode_prompt(plain, "12+3=?") == plain.encode("12+3=?", add_bos=True)
    no_template = HFTokenizer(build_tokenizer("char"))
    assert not no_template.use_chat_template
    assert encode_prompt(no_template, "12+3=?") == CharTokenizer().encode("12+3=?", add_bos=True)
    assert encode_tool_result(no_template, "[=15]") == CharTokenizer().encode("[=15]")
    request = generation_request([Prompt(uid="u", text="12+3=?", answer="15")], 2, True, chat)
    assert request.rows == [ids, ids]  # what producers generate from


def test_a_system_prompt_is_the_system_turn_of_every_prompt() -> None:
    system = "You are a calculator."
    chat = HFTokenizer(build_tokenizer("bpe", chat_template=True), system_prompt=system)
    ids = encode_prompt(chat, "Calculate 2 + 3.")
    assert chat.decode(ids, skip_special=False).replace(" ", "") == (
        "<bos><|system|>Youareacalculator.<eos><|user|>Calculate2+3.<eos><|assistant|>"
    )
    default = encode_prompt(HFTokenizer(build_tokenizer("bpe", chat_template=True)), "Calculate 2 + 3.")
    assert ids[-len(default) + 1:] == default[1:]  # the same user turn, after the system one
    with pytest.raises(ValueError, match="model.system_prompt='You are a calculator.'.*chat template"):
        HFTokenizer(build_tokenizer("bpe"), system_prompt=system)  # no template to render it with
    with pytest.raises(ValueError, match="model.system_prompt=.*chat template"):
        HFTokenizer(build_tokenizer("bpe", chat_template=True), chat_template=False, system_prompt=system)
    with pytest.raises(ConfigError, match="system_prompt=.You are a calculator.. needs backend=hf"):
        load_config(None, [f"model.system_prompt={system}"])  # the tiny model has no chat template


def test_model_attn_implementation_reaches_every_policy_and_keeps_the_log_probs(model_dir: Path) -> None:
    """model.attn_implementation=eager loads transformers' eager attention (trainer and producers alike), and
    behaviour log-probs from its KV-cached sampling equal its trainer's recompute on a batch padded on both
    sides, as sdpa's do; the tiny backend refuses the field, naming it."""
    hf = ["model.backend=hf", f"model.hf_path={model_dir}"]
    policy = build_policy(load_config(None, [*hf, "model.attn_implementation=eager"]), device="cpu")
    assert policy.module.config._attn_implementation == "eager"
    default = build_policy(load_config(None, hf), device="cpu")
    assert default.module.config._attn_implementation == "sdpa"
    trajs, ids, mask, R, groups = sampled(policy, 0.7)  # type: ignore[arg-type]
    with torch.no_grad():
        eager = policy.log_probs(ids, mask, R, temperature=0.7, groups=groups)
        sdpa = default.log_probs(ids, mask, R, temperature=0.7, groups=groups)
    err = max(abs(eager[i, j].item() - lp) for i, t in enumerate(trajs) for j, lp in enumerate(t.log_probs))
    assert err < 1e-5
    assert torch.allclose(eager * mask[:, -R:], sdpa * mask[:, -R:], atol=1e-4)  # the same model either way
    with pytest.raises(ConfigError, match="attn_implementation='eager' needs backend=hf"):
        load_config(None, ["model.attn_implementation=eager"])


def test_eager_gqa_attention_is_eagers_without_copying_key_value_heads(model_dir: Path) -> None:
    """model.attn_implementation=eager_gqa (4 query heads on 2 key/value heads here) loads rollstream's kernel
    in every policy; its sampling's behaviour log-probs equal its trainer's recompute, and its log-probs and
    gradients (float32) equal transformers' eager kernel's on a batch padded on both sides."""
    hf = ["model.backend=hf", f"model.hf_path={model_dir}"]
    gqa = build_policy(load_config(None, [*hf, "model.attn_implementation=eager_gqa"]), device="cpu")
    assert gqa.module.config._attn_implementation == "eager_gqa"
    assert gqa.module.config.num_attention_heads == 2 * gqa.module.config.num_key_value_heads
    eager = build_policy(load_config(None, [*hf, "model.attn_implementation=eager"]), device="cpu")
    trajs, ids, mask, R, groups = sampled(gqa, 0.7)  # type: ignore[arg-type]
    with torch.no_grad():
        got = gqa.log_probs(ids, mask, R, temperature=0.7, groups=groups)
    err = max(abs(got[i, j].item() - lp) for i, t in enumerate(trajs) for j, lp in enumerate(t.log_probs))
    assert err < 1e-5
    grads = []
    for policy in (gqa, eager):
        logp, _ = policy.forward_logprobs_entropy(ids, mask, R, temperature=0.7, groups=groups)
        (logp * mask[:, -R:]).sum().backward()
        grads.append({n: p.grad.clone() for n, p in policy.module.named_parameters() if p.grad is not None})
        assert torch.allclose(logp.detach() * mask[:, -R:], got * mask[:, -R:], atol=1e-5)
    assert grads[0].keys() == grads[1].keys() and any("k_proj" in n for n in grads[0])
    for name, g in grads[0].items():
        assert torch.allclose(g, grads[1][name], rtol=1e-4, atol=1e-6), name


def test_tool_results_go_in_the_templates_tool_turn() -> None:
    chat = HFTokenizer(build_tokenizer("bpe", chat_template=True))
    ids = encode_tool_result(chat, "[=15]")
    assert chat.decode(ids, skip_special=False) == "<eos><|tool|>[=15]<eos><|assistant|>"
    hf = build_tokenizer("char", chat_template=True)
    hf.chat_template = (
        "{% for m in messages %}{% if m['role'] != 'tool' %}{{ m['content'] }}{% endif %}{% endfor %}"
    )
    with pytest.raises(ValueError, match="tool message"):
        render_tool_turn(hf, "[=15]")


class ScriptedChatPolicy:
    """Turn 1 writes `[calc:EXPR]` then junk (cut by the loop); turn 2 answers with the tool's value."""

    def __init__(self, tokenizer: HFTokenizer) -> None:
        self.tokenizer = tokenizer
        self.max_seq_len = 128
        self.histories: list[str] = []

    def generate(self, prompts: list[list[int]], n: int, max_new_tokens: int, **_: Any) -> list[Completion]:
        tok, out = self.tokenizer, []
        for p in prompts:
            text = tok.decode(p, skip_special=False)
            self.histories.append(text)
            if "<|tool|>" in text:
                ids = tok.encode(text.rsplit("[=", 1)[1].split("]")[0]) + [tok.eos_id]
            else:
                ids = tok.encode(f"[calc:{tok.decode(p).split('=')[0]}]xx")
            out.append(Completion(list(p), ids, [-0.25] * len(ids), ids[-1] == tok.eos_id))
        return out


def test_multi_turn_tool_agent_with_a_chat_template() -> None:
    tok = HFTokenizer(build_tokenizer("bpe", chat_template=True))
    task = ArithToolTask()
    prompt = Prompt(uid="p", text="12*3+4=?", answer=str(calculate("12*3+4")))
    request = generation_request([prompt], 2, True, tok)
    policy = ScriptedChatPolicy(tok)
    settings = GenerationSettings(max_new_tokens=32, max_turns=3)
    trajs = run_agent_loop(policy, task, request, settings, FixedVersion(0))  # type: ignore[arg-type]
    call, turn, answer = (
        tok.encode("[calc:12*3+4]"),
        encode_tool_result(tok, "[=40]"),
        tok.encode("40") + [tok.eos_id],
    )
    assert (
        policy.histories[-1]
        == "<bos><|user|>12*3+4=?<eos><|assistant|>[calc:12*3+4]<eos><|tool|>[=40]<eos><|assistant|>"
    )
    for t in trajs:
        assert t.response_ids == call + turn + answer
        assert t.response_mask == [1] * len(call) + [0] * len(turn) + [1] * len(answer)
        assert t.log_probs == [-0.25] * len(call) + [0.0] * len(turn) + [-0.25] * len(answer)
        assert t.num_turns == 2 and t.finished
        assert task.reward(prompt, tok.decode(t.response_ids)).score == 1.0


def test_prompt_files_are_held_to_the_char_vocabulary_only_with_the_tiny_model(tmp_path: Path) -> None:
    from rollstream.tasks import build_prompt_source

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(f'{{"prompt": "Wie viel ist {i}+2? Über", "answer": "{i + 2}"}}\n' for i in range(3))
    )
    data = [f"data.prompts_file={prompts}", "data.val_size=1"]
    with pytest.raises(ValueError, match="outside the task vocabulary"):
        build_prompt_source(load_config(None, data))
    hf = build_prompt_source(load_config(None, [*data, "model.backend=hf", f"model.hf_path={tmp_path}"]))
    assert [p.text for p in hf.val_prompts()] == ["Wie viel ist 2+2? Über"]
