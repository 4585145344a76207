"""`rollout:`: the producers (engine, sampling, pacing leases, weight swaps, multi-turn tool use)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rollstream.config.base import Section


class MultiTurnConfig(Section):
    """Multi-turn tool use."""

    enable: bool = Field(False, description="Run the tool agent loop (arith task)")
    max_turns: int = Field(3, ge=1, description="Most assistant turns per trajectory")



class VLLMConfig(Section):
    """The vLLM engine of each producer (`rollout.name=vllm`)."""

    kv_cache_gib: int = Field(
        1,
        ge=1,
        description="CPU build: GiB of memory each producer's engine reserves for its KV cache "
                    "(VLLM_CPU_KVCACHE_SPACE)",
    )
    gpu_memory_utilization: float = Field(
        0.3,
        gt=0,
        le=1,
        description="CUDA build: share of GPU memory each producer's engine takes (the trainer shares the "
                    "GPU)",
    )
    cpu_threads_bind: str = Field(
        "nobind",
        description="CPU build: VLLM_CPU_OMP_THREADS_BIND ('nobind' keeps rollout.torch_threads; 'auto' or "
                    "core lists like '0-3|4-7' bind OpenMP threads)",
    )
    max_model_len: int | None = Field(
        None,
        ge=8,
        description="Longest prompt + response the engine plans for (null: the model's "
                    "max_position_embeddings)",
    )
    enforce_eager: bool | None = Field(
        None,
        description="Skip graph capture / compilation (null: eager on CPU, where compiling only delays the "
                    "start; CUDA graphs on a GPU, where eager decode is several times slower)",
    )
    enable_prefix_caching: bool = Field(
        True,
        description="Reuse the KV cache of a shared prompt across a group's n rows and a multi-turn history",
    )
    continuous: bool = Field(
        True,
        description="Keep rollout.prompts_per_dispatch prompts in the engine at all times, admitting leased "
                    "prompts as rows finish and publishing each group once scored (single-turn; false or "
                    "the tool agent loop: one batch per dispatch)",
    )



class RolloutConfig(Section):
    """The producers."""

    name: Literal["builtin", "vllm"] = Field(
        "builtin",
        description="Generation engine: builtin = the KV-cache sampling loop over the policy module; vllm = "
                    "one vLLM engine per producer (model.backend=hf)",
    )
    vllm: VLLMConfig = Field(
        default_factory=VLLMConfig, description="vLLM engine settings (rollout.name=vllm)"
    )

    continuous: bool = Field(
        False,
        description="Built-in engine: keep rollout.prompts_per_dispatch prompts in one running batch, "
                    "admitting leased prompts (and the tool agent's next turns) as rows finish and "
                    "publishing each group once scored (vLLM's own: rollout.vllm.continuous)",
    )
    n: int = Field(8, ge=1, description="Trajectories per prompt (GRPO group size)")
    num_producers: int = Field(2, ge=1, description="Producer processes started by `rollstream run`")
    prompts_per_dispatch: int = Field(
        4, ge=1, description="Prompts a producer takes budget for and generates in one batch"
    )
    generate_timeout_s: float | None = Field(
        1800.0,
        gt=0,
        description="Seconds one dispatch's generation may take; past it (a hung engine) its prompts are "
                    "published as rollout failures and the producer exits for its supervisor to restart "
                    "(null: no limit)",
    )
    temperature: float = Field(
        1.0,
        gt=0,
        description="Sampling temperature; behaviour log-probs and the trainer's log-probs both use logits / "
                    "temperature",
    )
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass")
    top_k: int = Field(
        -1,
        ge=-1,
        description="Sample among the k most likely tokens (-1: all, verl's default; 0 is refused); "
                    "behaviour log-probs stay those of the whole tempered distribution",
    )
    lease_timeout_s: float = Field(
        600.0,
        gt=0,
        description="Pacing: the longest a producer with unfinished leased prompts may go without progress "
                    "(seqs finished, entries with the trainer) before it loses them (taken back, leased to "
                    "others; a late publish of one is dead-lettered as `lease expired`); sooner, after 3 of "
                    "the slowest producer's dispatch times",
    )
    sync_every_tokens: int = Field(4, ge=1, description="Decode tokens between checks for newer weights")
    swap_check_max_diff: float | None = Field(
        None,
        gt=0,
        description="Swap check: most mean |log-prob difference| per probe token between the trainer and a "
                    "producer's engine after a weight swap (null: 1e-3 in float32, 0.15 in bfloat16, 2e-2 in "
                    "float16); over it the swap failed",
    )
    stats_every_s: float = Field(
        5.0, gt=0, description="Seconds between ProducerStats events (also sent on each new version)"
    )
    torch_threads: int = Field(
        1,
        ge=0,
        description="torch intra-op threads per producer process (0 = torch default); 1 avoids "
                    "oversubscribed cores",
    )
    nice: int = Field(
        0,
        ge=0,
        le=19,
        description="Raise each producer process's nice value by this much (CPU hosts: the trainer wins "
                    "shared cores)",
    )
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None,
        description="Weight dtype of the built-in engine's copy of the policy, which then computes in it "
                    "(no model.autocast); published weights are cast on load. null: model.dtype and "
                    "model.autocast, as the trainer",
    )
    multi_turn: MultiTurnConfig = Field(default_factory=MultiTurnConfig, description="Multi-turn tool use")
