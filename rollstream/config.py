"""The typed model of pipeline.yaml: one pydantic model for the whole run, overrides as dotted key=value."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rollstream.correction_spec import parse_is_threshold, parse_rs_options, parse_rs_thresholds


class ConfigError(Exception):
    """A pipeline.yaml or override that does not validate; the message names field, value and rule."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunConfig(_Section):
    """Where the run lives."""

    name: str = Field(
        "demo", description="Run name; every Redis key is rs:{<name>}:…", pattern=r"^[A-Za-z0-9_.-]{1,64}$"
    )
    redis_url: str | None = Field(
        None, description="Redis URL (redis://, rediss://, unix://); null = start an embedded redis-server"
    )
    password_file: str | None = Field(
        None, description="File holding the Redis password (instead of the URL)"
    )
    dir: str = Field(
        "runs", description="Parent folder of run directories (logs, checkpoints, supervisord config)"
    )
    seed: int = Field(0, description="Seed for prompts, model init and sampling")
    device: str = Field("auto", description="torch device: auto (cuda when present), cpu or cuda[:N]")
    acl: bool = Field(
        True,
        description="Embedded redis only: one ACL user per role (producer, trainer, aggregator, admin), "
                    "default user off",
    )


class DataConfig(_Section):
    """Prompts and batch sizes."""

    task: str = Field(
        "reverse",
        description="Task: reverse (digits), arith (arithmetic with a calculator tool), or rg:<dataset> (a "
                    "reasoning-gym dataset, e.g. rg:basic_arithmetic; needs model.backend=hf and the rg "
                    "extra)",
    )
    task_args: dict[str, Any] = Field(
        default_factory=dict,
        description="rg:<dataset> only: the dataset's settings (its reasoning-gym config fields), e.g. "
                    "{min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 2}",
    )
    instruction: str = Field(
        "", description="rg:<dataset> only: text put after each question on a new line (e.g. 'Answer with "
                        "the number only.')"
    )
    answer_extract: Literal["last_number", "answer_tag", "last_line", "whole"] = Field(
        "last_number",
        description="rg:<dataset> only: what of a response the verifier scores: its last number, its last "
                    "<answer>…</answer>, its last non-empty line, or all of it",
    )
    train_batch_size: int = Field(16, ge=1, description="Samples (prompts) per global step")
    min_digits: int = Field(3, ge=1, description="Reverse task: shortest digit string")
    max_digits: int = Field(6, ge=1, description="Reverse task: longest digit string")
    fixed_width: bool = Field(
        False,
        description="Reverse task: right-align the digits to max_digits with spaces (every prompt the same "
                    "length)",
    )
    prompts_file: str | None = Field(None, description="JSONL prompt file instead of the seeded generator")
    fresh_prompts: bool = Field(
        True,
        description="Seeded generator: draw a new prompt at every position (never a validation one) instead "
                    "of cycling epoch_size prompts",
    )
    epoch_size: int = Field(4096, ge=1, description="Generated prompts per epoch (seeded generator mode)")
    val_size: int = Field(256, ge=0, description="Held-out prompts used for validation")
    val_recent_size: int = Field(
        64,
        ge=0,
        description="Newest trained prompts re-decoded at each validation (`val/recent_train_…`; "
        "memorisation shows as a gap to `val/…`); 0 = none",
    )
    max_response_length: int = Field(12, ge=1, description="Max generated tokens per turn")

    @model_validator(mode="after")
    def _digits(self) -> DataConfig:
        if self.min_digits > self.max_digits:
            raise ValueError(f"min_digits={self.min_digits} must be <= max_digits={self.max_digits}")
        return self

    @model_validator(mode="after")
    def _task(self) -> DataConfig:
        if self.task.startswith("rg:"):
            if importlib.util.find_spec("reasoning_gym") is not None:  # else refused where the task is built
                from rollstream.tasks.reasoning_gym import check_spec

                check_spec(self.task.removeprefix("rg:"), self.task_args)
        elif self.task not in ("reverse", "arith"):
            raise ValueError(f"data.task={self.task!r} must be reverse, arith or rg:<reasoning-gym dataset>")
        elif self.task_args:
            raise ValueError(
                f"data.task_args={self.task_args!r} is for rg:<dataset> tasks, not data.task={self.task!r}"
            )
        return self


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


class ModelConfig(_Section):
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
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weight dtype on producers and trainer: auto = bfloat16 on CUDA, float32 on CPU"
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
        return self


class MultiTurnConfig(_Section):
    """Multi-turn tool use."""

    enable: bool = Field(False, description="Run the tool agent loop (arith task)")
    max_turns: int = Field(3, ge=1, description="Most assistant turns per trajectory")


class LatencyModelConfig(_Section):
    """Benchmarks only: a producer that models generation time instead of decoding (see
    benchmarks/latency.py)."""

    enable: bool = Field(
        False,
        description="Replace decoding by sleeping each dispatch's modelled decode time (rest of the producer "
                    "unchanged)",
    )
    tokens_per_s: float = Field(
        200.0, gt=0, description="Modelled decode speed of one trajectory in tokens per second"
    )
    length_median: float = Field(
        8.0, gt=0, description="Median modelled response length in tokens (lognormal)"
    )
    length_sigma: float = Field(
        1.0, ge=0, description="Log-space std of the modelled response length (the long tail)"
    )
    concurrency: int = Field(
        8,
        ge=1,
        description="Slots per producer, each dispatching one prompt at a time (an engine's continuous "
                    "batching)",
    )


class VLLMConfig(_Section):
    """The vLLM engine of each producer (`rollout.engine=vllm`)."""

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


class RolloutConfig(_Section):
    """The producers."""

    engine: Literal["builtin", "vllm"] = Field(
        "builtin",
        description="Generation engine: builtin = the KV-cache sampling loop over the policy module; vllm = "
                    "one vLLM engine per producer (model.backend=hf)",
    )
    vllm: VLLMConfig = Field(
        default_factory=VLLMConfig, description="vLLM engine settings (rollout.engine=vllm)"
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
    staleness_threshold: float = Field(
        0.0, ge=0, description="Pacing: at most train_batch_size*(1+staleness_threshold) prompts outstanding"
    )
    lease_timeout_s: float = Field(
        600.0,
        gt=0,
        description="Pacing: a producer none of whose leased prompts the trainer finished for this long, "
                    "while others' were, loses its unfinished lease (taken back, leased to others; a late "
                    "publish of one is dead-lettered as `lease expired`)",
    )
    partial_rollout: bool = Field(
        True, description="Swap weights mid-trajectory (start<end) instead of finishing under old weights"
    )
    sync_every_tokens: int = Field(4, ge=1, description="Decode tokens between checks for newer weights")
    swap_check_max_diff: float | None = Field(
        None,
        gt=0,
        description="Swap check: most mean |log-prob difference| per probe token between the trainer and a "
                    "producer's engine after a weight swap (null: 1e-3 in float32, 5e-2 in bfloat16, 2e-2 in "
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
    multi_turn: MultiTurnConfig = Field(default_factory=MultiTurnConfig, description="Multi-turn tool use")
    latency_model: LatencyModelConfig = Field(
        default_factory=LatencyModelConfig,
        description="Benchmarks: modelled generation time instead of decoding",
    )


class RolloutCorrectionConfig(_Section):
    """verl's rollout correction (algorithm.rollout_correction there): IS weights and rejection of tokens or
    sequences whose rollout log-probs disagree with the trainer's (rollstream/rl/rollout_correction.py)."""

    rollout_is: Literal["token", "sequence"] | None = Field(
        "token",
        description="IS weight pi_old/pi_rollout per token or per sequence (product); null = none (verl's "
                    "default)",
    )
    rollout_is_threshold: float | str = Field(
        5.0,
        description="IS bound: a number U truncates weights to <= U (TIS); 'L_U' zeroes weights outside [L, "
                    "U] (IcePop)",
    )
    rollout_is_batch_normalize: bool = Field(
        False, description="Divide IS weights by their mean over the mini-batch (every data-parallel rank's)"
    )
    rollout_rs: str | None = Field(
        None,
        description="Rejection: comma-separated token_k{1,2,3}, seq_sum_k{1,2,3}, seq_mean_k{1,2,3} "
                    "(geometric), "
        "seq_max_k{2,3} (veto); null = none",
    )
    rollout_rs_threshold: float | str | None = Field(
        None,
        description="Rejection bound(s), one or one per option: k1 takes ratio bounds 'L_U' (U alone: L = "
                    "1/U), k2/k3 an upper bound",
    )

    @model_validator(mode="after")
    def _parse(self) -> RolloutCorrectionConfig:
        parse_is_threshold(self.rollout_is_threshold)
        if self.rollout_rs is not None:
            parse_rs_thresholds(parse_rs_options(self.rollout_rs), self.rollout_rs_threshold)
        return self


class ActorConfig(_Section):
    """The policy-gradient update."""

    ppo_mini_batch_size: int = Field(8, ge=1, description="Samples per local update (one optimizer step)")
    lr: float = Field(3e-3, gt=0, description="AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    grad_clip: float = Field(1.0, gt=0, description="Max global grad norm")
    clip_ratio: float = Field(
        0.2, gt=0, description="PPO clip epsilon (low side, and high side unless clip_ratio_high)"
    )
    clip_ratio_high: float | None = Field(
        None, gt=0, description="PPO clip epsilon, high side (DAPO clip-higher)"
    )
    rollout_correction: RolloutCorrectionConfig = Field(
        default_factory=RolloutCorrectionConfig,
        description="verl's rollout correction: IS weights, rejection, mismatch metrics (the default: "
                    "min(pi_prox/pi_behave, 5))",
    )
    off_policy_mode: Literal["decoupled", "bypass"] = Field(
        "decoupled",
        description="decoupled = proximal log-probs pinned per global step; bypass = behaviour log-probs as "
                    "old policy",
    )
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = Field(
        "token-mean", description="How token losses are aggregated"
    )
    kl_coef: float = Field(0.0, ge=0, description="Weight of KL to the frozen reference policy (0 = off)")
    entropy_coef: float = Field(
        0.0, ge=0, description="Entropy bonus weight (at global step 1 when entropy_decay_steps > 0)"
    )
    entropy_decay_steps: int = Field(
        0,
        ge=0,
        description="Decay the entropy bonus linearly to 0 over this many global steps (0 = constant)",
    )
    adv_estimator: Literal["grpo", "grpo_token", "reinforce_plus_plus"] = Field(
        "grpo",
        description="grpo = one outcome advantage per response; grpo_token = token-level credit "
        "(return-to-go vs the group's same position); reinforce_plus_plus = token returns whitened "
        "over the whole mini-batch (verl's name)",
    )
    gamma: float = Field(
        1.0,
        ge=0,
        le=1,
        description="grpo_token / reinforce_plus_plus: discount of later token rewards in a token's return "
        "(1 = return-to-go, 0 = its own reward)",
    )
    norm_adv_by_std: bool = Field(
        True,
        description="GRPO: divide group-centred rewards by the group std (False = Dr. GRPO, centring only)",
    )
    norm_adv_by_mean: bool = Field(
        False,
        description="grpo_token: divide group-centred returns by the group's mean |return|, not the std (the "
        "gradient of log P(right) per position; rarely-right positions weigh as much as solved ones)",
    )
    micro_batch_size: int = Field(
        0,
        ge=0,
        description="Trajectories per forward/backward inside a local update, gradients accumulated (0 = all "
        "at once)",
    )
    gradient_checkpointing: bool = Field(
        False,
        description="Recompute decoder-layer activations in backward instead of keeping them "
        "(model.backend=hf)",
    )
    logprob_chunk_size: int = Field(
        1024,
        ge=0,
        description="Tokens per output-head chunk when computing log-probs/entropy (0 = all at once; "
        "backend=hf)",
    )

    @model_validator(mode="before")
    @classmethod
    def _behave_imp_cap(cls, data: Any) -> Any:
        """`actor.behave_imp_cap=C` (the old single truncated weight) reads as token-level TIS with threshold
        C."""
        if not isinstance(data, dict) or "behave_imp_cap" not in data:
            return data
        data = dict(data)
        cap = data.pop("behave_imp_cap")
        correction = dict(data.get("rollout_correction") or {})
        if "rollout_is_threshold" in correction or "rollout_is" in correction:
            raise ValueError(
                f"actor.behave_imp_cap={cap!r} is the old name of "
                "actor.rollout_correction.rollout_is_threshold: set one"
            )
        data["rollout_correction"] = {**correction, "rollout_is": "token", "rollout_is_threshold": cap}
        return data


class FilterGroupsConfig(_Section):
    """DAPO dynamic sampling (verl's algorithm.filter_groups): groups without reward variance are not
    trained."""

    enable: bool = Field(
        False,
        description="Evict groups whose trajectories all got the same reward (no GRPO signal) and refill the "
        "batch",
    )


class TrainerConfig(_Section):
    """The trainer consumer."""

    parameter_sync_step: int = Field(
        2, ge=1, description="Local updates per global step (one weight publish each)"
    )
    max_off_policy_threshold: int = Field(
        2, description="Drop samples with staleness (global_step - param_version) above this"
    )
    max_off_policy_strategy: Literal["drop", "train"] = Field(
        "drop",
        description="Samples over the threshold: drop (recorded) or train them, weighted by "
        "actor.rollout_correction",
    )
    filter_groups: FilterGroupsConfig = Field(
        default_factory=FilterGroupsConfig,
        description="Dynamic sampling: zero-variance groups evicted, budget given back",
    )
    num_warmup_batches: int = Field(
        1, ge=0, description="Mini-batches of samples the trainer waits for before its first update (as verl)"
    )
    total_global_steps: int = Field(50, ge=1, description="Stop after this many global steps")
    save_freq: int = Field(
        1, ge=1, description="Checkpoint every this many global steps (rollouts acked only after)"
    )
    keep_checkpoints: int = Field(
        2,
        ge=1,
        description="Newest checkpoints kept on disk; `rollstream replay trainer --steps A-B` needs step "
        "A-1's",
    )
    test_freq: int = Field(5, ge=0, description="Validate every this many versions (0 = never)")
    heartbeat_stall_s: float = Field(
        120.0,
        gt=0,
        description="`rollstream status` marks the trainer stalled when its heartbeat is older (`--check` "
        "exits 1)",
    )
    sync_mode: bool = Field(
        False,
        description="Collect the full global batch before training, as synchronous RL does (benchmarks)",
    )
    torch_threads: int = Field(
        1,
        ge=0,
        description="torch intra-op threads of each trainer process (0 = torch default); 1 avoids "
        "oversubscribed cores",
    )
    nproc_per_node: int = Field(
        1,
        ge=1,
        description="Data-parallel trainer ranks per host; > 1 (or nnodes > 1) launches the trainer under "
        "torchrun",
    )
    nnodes: int = Field(
        1, ge=1, description="Hosts running trainer ranks (one torchrun per host, same rendezvous)"
    )
    rdzv_endpoint: str | None = Field(
        None,
        description="torchrun rendezvous host:port (c10d) shared by every trainer host; null = standalone on "
        "one host",
    )
    max_restarts: int = Field(
        3,
        ge=0,
        description="torchrun restarts of the whole rank group after a rank fails, before torchrun itself "
        "exits",
    )
    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp",
        description="Data parallel: ddp = replicated weights, averaged gradients; fsdp = fully_shard (CUDA "
        "only)",
    )

    @model_validator(mode="after")
    def _threshold(self) -> TrainerConfig:
        if self.max_off_policy_threshold < 1:
            raise ValueError(
                f"max_off_policy_threshold={self.max_off_policy_threshold} must be >= 1 (1 = on-policy only)"
            )
        return self

    @property
    def world_size(self) -> int:
        """Trainer ranks in all: nnodes * nproc_per_node."""
        return self.nnodes * self.nproc_per_node

    @property
    def distributed(self) -> bool:
        """True when the trainer runs as torchrun ranks (more than one rank, or fsdp, which needs a process
        group)."""
        return self.world_size > 1 or self.strategy == "fsdp"


class BusConfig(_Section):
    """Redis Streams transport."""

    block_ms: int = Field(1000, ge=1, description="XREADGROUP BLOCK time")
    read_count: int = Field(64, ge=1, description="Entries per XREADGROUP call")
    claim_idle_s: float = Field(
        60.0, gt=0, description="XAUTOCLAIM entries idle longer than this from dead consumers"
    )
    max_deliveries: int = Field(5, ge=1, description="Deliveries before an entry goes to dead")
    socket_timeout_s: float = Field(10.0, gt=0, description="Socket timeout (must exceed block_ms)")
    max_stream_bytes: int = Field(
        2 << 30,
        ge=1 << 20,
        description="Safety-net cap per stream: beyond it even unread entries go to the archive (logged "
        "loudly when it bites)",
    )
    retention: bool = Field(
        True,
        description="Move old entries of the log from Redis to the archive (off: the whole log stays in "
        "Redis)",
    )
    redis_max_bytes: int = Field(
        2 << 30,
        ge=1 << 16,
        description="Budget of the run's streams in Redis: over it, read entries go to the archive; unread "
        "data over it paces producers to one step per version",
    )
    archive_uri: str | None = Field(
        None, description="Folder (local path or file:// URI) of the log archive; null = <run dir>/archive"
    )
    trim_every_s: float = Field(
        10.0, gt=0, description="Seconds between retention passes (when retention is on)"
    )
    audit_maxlen: int = Field(
        100_000,
        ge=100,
        description="With retention on: newest entries kept in Redis in fates, dispatch_log and params "
        "(older ones archived)",
    )
    records_maxlen: int = Field(
        0,
        ge=0,
        description="With retention on: newest records kept in Redis (0 = as the budget allows; older ones "
        "archived)",
    )
    weights_inline_max_bytes: int = Field(
        64 << 20,
        ge=0,
        description="Weight blobs up to this size go in Redis as one string; larger ones per "
        "bus.weights_transport",
    )
    weights_transport: Literal["file", "redis"] = Field(
        "file",
        description="Weights above the inline limit: `file` = the trainer's run dir (producers must share "
        "that disk); "
        "`redis` = chunks in Redis (producers on hosts with no shared disk; Redis holds the versions still "
        "in use)",
    )
    weights_chunk_bytes: int = Field(
        16 << 20,
        ge=1 << 10,
        le=512 << 20,
        description="Size of one weights chunk in Redis (weights_transport=redis); also a producer's extra "
        "memory",
    )
    max_entry_bytes: int = Field(
        64 << 20,
        ge=1024,
        description="Largest stream entry (all fields together) accepted on decode; larger ones go to dead",
    )

    redis_maxmemory_bytes: int = Field(
        0,
        ge=0,
        description="maxmemory of the embedded Redis (policy noeviction: a write past it is refused, nothing "
        "evicted); 0 = from the budget: 3 x redis_max_bytes + 4 x weights_inline_max_bytes + 256 MiB (with "
        "weights_transport=redis or retention off none: set it, the chunks or the whole log come on top)",
    )
    producer_max_bytes: int = Field(
        0,
        ge=0,
        description="Per-producer memory bound: past it (MEMORY USAGE of its two streams, sampled, or over "
        "PRODUCER_KEYS_MAX_BYTES in its four keys) the trainer fences the producer (ACL user off, "
        "connections killed); 0 = 1.25 x redis_max_bytes + max_entry_bytes (retention keeps all streams "
        "near redis_max_bytes, so one honest producer's never passes it; with retention off only its keys "
        "are bounded)",
    )

    def maxmemory(self) -> int | None:
        """maxmemory for the embedded Redis in bytes, or None for none (see redis_maxmemory_bytes)."""
        if self.redis_maxmemory_bytes:
            return self.redis_maxmemory_bytes
        if self.weights_transport == "redis" or not self.retention:
            return None  # chunks on top, or the whole log kept in Redis: not boundable from the budget
        return 3 * self.redis_max_bytes + 4 * self.weights_inline_max_bytes + (256 << 20)

    def producer_bound(self) -> int | None:
        """The per-producer bound on its streams in bytes (see producer_max_bytes); None (its keys are still
        bounded) with retention off and no explicit bound: the whole log then stays in Redis."""
        if self.producer_max_bytes:
            return self.producer_max_bytes
        if not self.retention:
            return None
        return self.redis_max_bytes + self.redis_max_bytes // 4 + self.max_entry_bytes

    @model_validator(mode="after")
    def _memory_bounds(self) -> BusConfig:
        if self.redis_maxmemory_bytes and self.redis_maxmemory_bytes < 2 * self.redis_max_bytes:
            raise ValueError(
                f"redis_maxmemory_bytes={self.redis_maxmemory_bytes} must be 0 (from the budget) or at least "
                f"2 x redis_max_bytes={self.redis_max_bytes}: the streams' budget needs headroom"
            )
        return self

    @model_validator(mode="after")
    def _archive_local(self) -> BusConfig:
        uri = self.archive_uri
        if uri is not None and "://" in uri and not uri.startswith("file://"):
            raise ValueError(f"archive_uri={uri!r}: only a local path or a file:// URI is supported")
        return self

    def archive_dir(self, run_dir: Path) -> Path:
        """The log archive's folder: archive_uri (file:// stripped) or <run dir>/archive."""
        return Path(self.archive_uri.removeprefix("file://")) if self.archive_uri else run_dir / "archive"

    @model_validator(mode="after")
    def _timeouts(self) -> BusConfig:
        if self.socket_timeout_s * 1000 <= self.block_ms:
            raise ValueError(
                f"socket_timeout_s={self.socket_timeout_s} must exceed block_ms={self.block_ms} ms"
            )
        return self


class AggregatorConfig(_Section):
    """The metrics aggregator consumer."""

    incomplete_timeout_s: float = Field(
        120.0, gt=0, description="Report a global step still incomplete after this"
    )
    total_gpus: int = Field(1, ge=1, description="GPUs behind perf/throughput")
    jsonl: bool = Field(True, description="Write records to <run dir>/records.jsonl")
    tensorboard: bool = Field(
        True, description="Also write TensorBoard scalars when tensorboard is installed"
    )
    wandb_project: str | None = Field(
        None, description="Also log to this wandb project when wandb is installed"
    )
    max_deliveries: int = Field(
        1000,
        ge=1,
        description="Deliveries before a metrics entry goes to dead (high: a restart re-delivers "
        "kept-pending entries)",
    )


class PipelineConfig(_Section):
    """The whole run (pipeline.yaml)."""

    run: RunConfig = Field(default_factory=RunConfig, description="Run identity and Redis")
    data: DataConfig = Field(default_factory=DataConfig, description="Prompts and batch sizes")
    model: ModelConfig = Field(default_factory=ModelConfig, description="Policy network")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Producers")
    actor: ActorConfig = Field(default_factory=ActorConfig, description="Policy update")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="Trainer consumer")
    bus: BusConfig = Field(default_factory=BusConfig, description="Redis Streams transport")
    aggregator: AggregatorConfig = Field(default_factory=AggregatorConfig, description="Metrics aggregator")

    @model_validator(mode="after")
    def _batch_sizes(self) -> PipelineConfig:
        tbs, pss, mbs = (
            self.data.train_batch_size,
            self.trainer.parameter_sync_step,
            self.actor.ppo_mini_batch_size,
        )
        if tbs != pss * mbs:
            raise ValueError(
                f"data.train_batch_size={tbs} must equal trainer.parameter_sync_step={pss} "
                f"* actor.ppo_mini_batch_size={mbs} (= {pss * mbs})"
            )
        world, nodes, procs = self.trainer.world_size, self.trainer.nnodes, self.trainer.nproc_per_node
        if mbs % world:
            raise ValueError(
                f"actor.ppo_mini_batch_size={mbs} must be divisible by the trainer world size "
                f"trainer.nnodes={nodes} * trainer.nproc_per_node={procs} (= {world}): each rank trains "
                "ppo_mini_batch_size / world_size samples per local update"
            )
        if nodes > 1 and not self.trainer.rdzv_endpoint:
            raise ValueError(
                f"trainer.nnodes={nodes} needs trainer.rdzv_endpoint (host:port every trainer host reaches)"
            )
        if self.rollout.engine == "vllm" and self.model.backend != "hf":
            raise ValueError(
                f"rollout.engine=vllm needs model.backend=hf (model.backend={self.model.backend!r}: vLLM "
                "loads a HF checkpoint)"
            )
        if self.rollout.engine == "vllm" and self.rollout.top_p < 1.0:
            raise ValueError(
                f"rollout.top_p={self.rollout.top_p} with rollout.engine=vllm: vLLM's log-probs are then "
                "those of the "
                "top-p-renormalised distribution, not log_softmax(logits / temperature) the trainer "
                "recomputes; use top_p=1"
            )
        if self.data.task.startswith("rg:") and self.model.backend != "hf":
            raise ValueError(
                f"data.task={self.data.task} needs model.backend=hf (the tiny GPT's character vocabulary "
                "cannot spell reasoning-gym questions)"
            )
        if self.actor.gradient_checkpointing and self.model.backend != "hf":
            raise ValueError(
                "actor.gradient_checkpointing=true needs model.backend=hf "
                f"(model.backend={self.model.backend!r} has none)"
            )
        return self

    @property
    def max_outstanding(self) -> int:
        """Pacing bound: train_batch_size * (1 + staleness_threshold) prompts dispatched but not consumed."""
        return int(self.data.train_batch_size * (1 + self.rollout.staleness_threshold))

    def run_dir(self) -> Path:
        """The run's own folder: <run.dir>/<run.name>."""
        return Path(self.run.dir) / self.run.name


def _format_error(err: ValidationError, data: dict[str, Any]) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            lines.append(f"{loc}: unknown key (value {e['input']!r})")
        elif loc and isinstance(e["input"], dict):  # a section's own check: its message names the fields
            lines.append(msg if msg.startswith(f"{loc}.") else f"{loc}: {msg}")
        elif loc:
            lines.append(f"{loc}={e['input']!r}: {msg}")
        else:
            lines.append(msg)
    return "invalid config: " + "; ".join(lines)


def _parse_scalar(text: str) -> Any:
    # YAML scalar rules give ints, floats, bools and null; the model then types them. YAML 1.1 reads
    # "0.5_2" as the number 0.52: a value with an underscore stays text (the model still parses 1_000).
    if "_" in text:
        return text
    try:
        return yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        return text


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply dotted `a.b.c=value` overrides to a raw config dict (values parsed as YAML scalars)."""
    for item in overrides:
        m = re.fullmatch(r"([A-Za-z_][\w.]*)=(.*)", item, flags=re.S)
        if not m:
            raise ConfigError(f"override {item!r}: expected dotted.key=value")
        path, value = m.group(1).split("."), _parse_scalar(m.group(2))
        node = data
        for part in path[:-1]:
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {item!r}: {part} is not a section")
            node = nxt
        node[path[-1]] = value
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> PipelineConfig:
    """Load pipeline.yaml (or defaults when path is None), apply overrides, validate; raise ConfigError."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"cannot read config {path}: {e}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config {path}: top level must be a mapping, got {type(loaded).__name__}")
        data = loaded or {}
    data = apply_overrides(data, list(overrides or []))
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_error(e, data)) from None


def config_to_yaml(cfg: PipelineConfig) -> str:
    """The resolved config as YAML (logged at start, written into the run dir)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
