"""`model:`: the policy network (the tiny GPT's shape rule included, torch-free)."""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import Field, model_validator

from rollstream.config.base import Section

#: Tiny GPT position schemes: absolute learned embeddings (GPT-2), rotary (as Llama/Qwen), or both: the
#: embeddings give each token its absolute position, the rotation makes attention scores depend on the
#: query-key offset. Here (torch-free) so the config and rollstream.model.gpt read one definition.
Position = Literal["learned", "rope", "learned+rope"]


def gpt_shape_error(d_model: int, n_head: int, position: str) -> str | None:
    """Why a tiny GPT of this width, head count and position scheme cannot be built (naming the field and
    value), or None."""
    if d_model % n_head:
        return f"d_model={d_model} must be divisible by n_head={n_head}"
    if position not in get_args(Position):
        return f"position={position!r} must be one of {get_args(Position)}"
    if position != "learned" and (d_model // n_head) % 2:
        return f"position={position!r} needs an even head size, got d_model/n_head={d_model // n_head}"
    return None


class ModelConfig(Section):
    """The policy network."""

    backend: Literal["tiny", "hf"] = Field(
        "tiny", description="tiny = built-in char GPT; hf = transformers causal LM"
    )
    hf_path: str | None = Field(
        None, description="Local directory of the HF model and tokenizer (backend=hf)"
    )
    pretrained: str | None = Field(
        None,
        description="backend=hf: a model `rollstream model list` knows (e.g. smollm2-135m-instruct); hf_path "
                    "defaults to its cache folder, and `rollstream run` builds it there when missing",
    )
    d_model: int = Field(64, ge=8, description="Tiny GPT: embedding width")
    n_layer: int = Field(2, ge=1, description="Tiny GPT: transformer blocks")
    n_head: int = Field(4, ge=1, description="Tiny GPT: attention heads")
    max_seq_len: int = Field(64, ge=8, description="Tiny GPT: longest prompt+response in tokens")
    position: Position = Field(
        "learned",
        description="Tiny GPT: learned absolute position embeddings, rotary positions (as Llama/Qwen), or "
                    "both (learned+rope: absolute embeddings added to the input and rotary queries/keys)",
    )
    init_from: str | None = Field(
        None,
        description="safetensors weights the trainer starts from instead of the seeded init (e.g. "
                    "scripts/warm_start.py output)",
    )
    dtype: Literal["auto", "fast", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Weight dtype on producers and trainer: auto = bfloat16 on CUDA, float32 on CPU; fast "
                    "= bfloat16 on CUDA and, on a CPU, whichever of bfloat16 and float32 it multiplies "
                    "faster (measured once per machine, kept in ~/.cache/rollstream/fast-dtype.json; "
                    "float32 without AVX512-BF16 or AMX, where bfloat16 is emulated ~9x slower)",
    )
    autocast: Literal["bfloat16", "float16"] | None = Field(
        None,
        description="Compute dtype of every forward pass (torch.autocast) over model.dtype weights, on "
                    "producers and trainer: bfloat16 over float32 keeps float32 master weights and optimizer "
                    "at bfloat16 matmul speed (CPUs with AVX512-BF16 or AMX, GPUs); null: model.dtype",
    )
    chat_template: bool = Field(
        True,
        description="backend=hf: render prompts and tool results with the tokenizer's chat template when it "
                    "has one",
    )
    system_prompt: str | None = Field(
        None,
        description="backend=hf with chat_template: the system turn every prompt is rendered after (null = "
                    "the template's default, SmolLM2's 'You are a helpful AI assistant named SmolLM…')",
    )

    attn_implementation: Literal["sdpa", "eager", "eager_gqa"] | None = Field(
        None,
        description="backend=hf: the attention kernel on trainer, built-in producers and validation (null = "
                    "transformers' default, sdpa). On CPU eager's backward is ~30 % cheaper for short rows "
                    "(sdpa's bfloat16 flash backward: a quarter of an update); eager_gqa is eager without "
                    "copying grouped-query key/value heads (rollstream.model.attention); vLLM ignores it",
    )

    lora_rank: int = Field(
        0,
        ge=0,
        description="LoRA rank (verl's actor_rollout_ref.model.lora_rank): 0 trains every weight; > 0 "
                    "freezes them and trains rank-r factors on target_modules, which a version publishes "
                    "alone and producers load onto the same base (rollstream.model.lora)",
    )
    lora_alpha: float = Field(
        16.0, gt=0, description="LoRA scale numerator: the update B A is multiplied by lora_alpha / lora_rank"
    )
    target_modules: str | list[str] = Field(
        "all-linear",
        description="Linear layers LoRA adapts: all-linear (every one but the output head) or their last "
                    "name components, e.g. [q_proj, v_proj]",
    )

    @model_validator(mode="before")
    @classmethod
    def _pretrained_folder(cls, data: Any) -> Any:
        """hf_path defaults to model.pretrained's cache folder (an unknown name is refused, naming those
        known)."""
        if isinstance(data, dict) and data.get("pretrained") is not None:
            from rollstream.pretrained import model_dir  # torch-free

            folder = str(model_dir(str(data["pretrained"])))
            if not data.get("hf_path"):
                data = {**data, "hf_path": folder}
        return data

    @model_validator(mode="after")
    def _shape(self) -> ModelConfig:
        problem = gpt_shape_error(self.d_model, self.n_head, self.position)
        if problem:
            raise ValueError(problem)
        if self.pretrained is not None and self.backend != "hf":
            raise ValueError(f"pretrained={self.pretrained!r} needs backend=hf, got {self.backend!r}")
        if self.backend == "hf" and not self.hf_path:
            raise ValueError("backend=hf needs hf_path (or pretrained)")
        if self.system_prompt is not None and (self.backend != "hf" or not self.chat_template):
            raise ValueError(f"system_prompt={self.system_prompt!r} needs backend=hf and chat_template: true "
                             f"(got backend={self.backend!r}, chat_template={self.chat_template!r})")
        if isinstance(self.target_modules, str) and self.target_modules != "all-linear":
            raise ValueError(f"target_modules={self.target_modules!r}: expected all-linear or a list of "
                             "layer names (e.g. [q_proj, v_proj])")
        if self.attn_implementation is not None and self.backend != "hf":
            raise ValueError(f"attn_implementation={self.attn_implementation!r} needs backend=hf, "
                             f"got {self.backend!r}")
        return self

