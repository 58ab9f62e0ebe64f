"""Engine options, named as SGLang's server arguments where those exist. Unknown options are errors."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from radixlm.core.errors import InvalidRequestError

if TYPE_CHECKING:
    import torch

# The waiting-queue orders (core.runtime.scheduler.policy implements them). Here, not there: the CLI
# checks its arguments through these options without importing torch, which the policy's module does.
POLICIES = ("lpm", "dfs-weight", "fcfs", "lof", "random")

# Names accepted for each torch dtype (torch itself is imported only when an engine starts).
_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16", "half": "float16"}

# kv_cache_dtype's names (SGLang's and vLLM's --kv-cache-dtype) and their torch dtypes; "auto": the model's.
# speculative_algorithm's values; SGLang's STANDALONE is `draft` (`_resolve` takes either, in any case).
SPECULATIVE_ALGORITHMS = ("ngram", "draft", "eagle", "eagle3")
SPECULATIVE_ALIASES = {"standalone": "draft"}

KV_CACHE_DTYPES = {"auto": None, "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def option(default: Any, help: str, *, choices: Sequence[str] | None = None,
           aliases: Sequence[str] = ()) -> Any:
    """A documented option field: its help text, allowed values and other spellings (vLLM's) are the
    one source for the `radixlm serve` flags and the docs."""
    return field(default=default, metadata={"help": help, "choices": tuple(choices) if choices else None,
                                            "aliases": tuple(aliases)})


# The most draft tokens a tree holds: with its root, 64 verify rows, one bit each in the kernels' tree mask.
MAX_TREE_NODES = 63

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def _checked_type(name: str, annotation: str, value: Any) -> Any:
    """The value of option `name` if it has its field's type (an int also serves a float option);
    InvalidRequestError otherwise. Strict: "false" is not a bool, 1 is not a bool, True is not an int."""
    kind, optional = annotation.removesuffix(" | None"), annotation.endswith(" | None")
    if value is None and optional:
        return value
    if kind == "bool" and isinstance(value, bool):
        return value
    if kind in ("int", "float") and isinstance(value, int) and not isinstance(value, bool):
        return float(value) if kind == "float" else value
    if kind in ("float", "str") and isinstance(value, float if kind == "float" else str):
        return value
    wanted = {"bool": "true or false", "int": "an integer", "float": "a number", "str": "a string"}[kind]
    raise InvalidRequestError(f"{name} must be {wanted}{' or None' if optional else ''} (got {value!r})", name)


@dataclass
class EngineOptions:
    """Engine options, named as SGLang's server arguments (vLLM's spellings are CLI aliases)."""

    dtype: str = option("auto", "weight and activation dtype; auto: bfloat16 on CUDA, float32 on CPU",
                        choices=("auto", *_DTYPES))
    kv_cache_dtype: str = option(
        "auto", "dtype of the KV cache: auto (the model's dtype), fp8_e4m3 or fp8_e5m2 (half the bytes per token of "
        "bf16: twice the tokens in the same memory, half the KV read per decode step; values stored unscaled, "
        "saturating at the format's largest finite value; docs/engine.md)", choices=tuple(KV_CACHE_DTYPES))
    device: str | None = option(None, "device to run on, e.g. cuda, cuda:1, cpu; default: cuda if available")
    context_length: int | None = option(
        None, "the longest prompt plus completion a request may have, in tokens; default: the model's "
        "(max_position_embeddings, capped by a sliding window); may only be lowered",
        aliases=("--max-model-len",))
    tokenizer_path: str | None = option(None, "tokenizer directory or hub id; default: the model's",
                                        aliases=("--tokenizer",))
    chat_template: str | None = option(
        None, "Jinja chat template for /v1/chat/completions: a file path or the template text; default: "
        "the tokenizer's")
    trust_remote_code: bool = option(False, "let the tokenizer load custom code shipped with the checkpoint")
    schedule_policy: str = option("lpm", "order of the waiting queue: lpm (longest cached prefix first), "
                                  "dfs-weight, fcfs, lof (longest output first), random", choices=POLICIES)
    schedule_only_under_pressure: bool = option(
        True, "lpm and dfs-weight reorder the queue only while the waiting prompts outgrow the free KV slots "
        "(before that every order gets the same cache hits); false: always")
    schedule_fairness_bound: int = option(
        32, "a waiting request passed over this many times by better-matching ones goes first")
    schedule_admission_batch: int = option(
        0, "while requests are running and waiting, admit waiting ones only once this many running slots "
        "are free (or all the waiting fit): fewer, larger prefill steps under a long queue; 0: as slots free")
    chunked_prefill_size: int = option(
        8192, "token budget of one prefill step; longer prompts are prefilled in chunks; -1 disables "
        "chunking", aliases=("--max-prefill-tokens", "--max-num-batched-tokens"))
    max_running_requests: int | None = option(None, "most requests decoded together; default 512 on CUDA, "
                                              "64 on CPU", aliases=("--max-num-seqs",))
    max_total_tokens: int | None = option(
        None, "KV pool size in tokens; default: from mem_fraction_static on CUDA; on CPU at most twice the "
        "weights' bytes (at least 256 MiB) within a quarter of mem_fraction_static of the available RAM")
    mem_fraction_static: float = option(0.9, "fraction of GPU memory for weights and the KV pool",
                                        aliases=("--gpu-memory-utilization",))
    disable_radix_cache: bool = option(False, "do not reuse cached prefixes across requests")
    hicache_size_gb: float = option(0.0, "GiB of host memory (pinned on CUDA) for a second radix cache tier: "
                                    "KV evicted from the device pool is written there and loaded back on a "
                                    "prefix hit instead of recomputed (docs/engine.md); 0: off")
    hicache_write_policy: str = option("write_back", "when KV goes to the host tier: write_back (when evicted "
                                       "from the device) or write_through (as soon as it is cached)",
                                       choices=("write_back", "write_through"))
    disable_jump_forward: bool = option(False, "do not jump over text a constraint forces")
    enable_overlap_schedule: bool | None = option(
        None, "overlap scheduling: launch the next decode step (its input the sampled tokens, still on the "
        "device) before applying the current one's results on the host, so host work hides under the GPU "
        "(docs/engine.md); default: on for one CUDA device (tp_size and dp_size 1), off otherwise (a CPU "
        "device is synchronous: nothing to hide)")
    grammar_backend: str = option(
        "radixlm", "constrained decoding backend (regex, JSON schema, choices): radixlm (its grammar engine), "
        "llguidance (the optional llguidance package)",
        choices=("radixlm", "llguidance"))
    grammar_max_compile_seconds: float = option(
        2.0, "compile-time budget of one constraint (schema conversion and grammar compilation); past it "
        "the request gets 400")
    grammar_prepare_at_start: bool = option(
        True, "build what constrained decoding needs of the tokenizer (its byte trie, the vocabulary read as "
        "JSON string content: about 1-2 s of CPU for a 150k vocabulary; the token classes of the terminals most "
        "JSON schemas share: about 0.3 s) on a thread when the engine starts, "
        "so that the first constrained request does not wait for it (radixlm backend); false: at the first "
        "constraint")
    json_schema_documents: str | None = option(
        None, "a directory of JSON schemas that request schemas may `$ref` by URI: each *.json file (recursively) "
        "registered under its `$id` (docs/constrained.md); None: refs resolve within the request's schema only")
    grammar_max_configs: int = option(
        200_000, "parser configurations (about 1.2 KB each) a schema's shared tables hold before new "
        "requests get fresh ones")
    grammar_warm_seconds: float = option(
        0.0, "wall-clock seconds a new constraint's compile spends building the token classes and exit walks "
        "of the parser configurations its first masks most likely need (radixlm backend; 0: none, they are "
        "built by those masks)")
    gc_freeze: bool = option(
        True, "once the engine has started (and again when the vocabulary's grammar tables are built), move the "
        "objects alive then out of Python's garbage collector's generations (gc.freeze; undone at shutdown): a full "
        "collection, which pauses the whole process, no longer traverses them (docs/engine.md)")
    gc_warning_threshold_ms: float = option(
        100.0, "log a warning when one garbage collection pauses the process longer than this (0: never)")
    random_seed: int = option(0, "seed of the sampler and the random schedule policy", aliases=("--seed",))
    stream_interval: int = option(1, "send a streamed chunk every this many tokens (larger: less overhead)")
    log_level: str = option("warning", "level of the engine's log ('radixlm' logger)", choices=LOG_LEVELS)
    served_model_name: str | None = option(None, "model name in responses and /v1/models; default: the model "
                                           "directory's name")
    max_queued_requests: int | None = option(4096, "requests waiting beyond the running batch; past it "
                                             "submitting raises QueueFullError and the server answers 503 with "
                                             "Retry-After (None: unbounded)")
    max_requests_per_call: int = option(1024, "engine requests (prompts x n) one generate call or HTTP request "
                                        "may make; past it a 400")
    prepare_timeout: float = option(10.0, "seconds tokenizing a big prompt, or compiling a constraint, may take "
                                    "before the request is refused as too complex (400)")
    max_image_bytes: int = option(20 << 20, "largest encoded image (bytes) a request may carry; past it a 400")
    max_image_pixels: int = option(
        25_000_000, "largest decoded image (width x height) a request may carry; past it a 400")
    max_video_frames: int = option(
        64, "most frames one video (video_data, Qwen2-VL) may have; each frame is also held to max_image_pixels")
    prepare_workers: int = option(2, "threads for tokenizing big prompts, and as many for compiling constraints")
    stall_timeout: float = option(60.0, "seconds the scheduler loop may go without progress while requests are "
                                  "in flight before /health answers 503")
    request_timeout: float | None = option(
        None, "seconds a request may take from its arrival to its last token, unless it sets its own `timeout`; "
        "past it the request ends with its KV freed (HTTP 408, code timeout; a stream's last event says so). "
        "None: no limit")
    debug_check_invariants: bool = option(False, "verify the KV slot invariant after every step (slow)")
    disable_cuda_graph: bool = option(False, "CUDA only: run decode eagerly instead of replaying captured graphs")
    disable_cpu_prepack: bool = option(False, "CPU only: run linear layers with F.linear on the plain weights "
                                       "instead of copies prepacked for oneDNN once at load")
    cpu_plain_linear_max_rows: int = option(1, "CPU only: products of at most this many rows (batch-1 decode) "
                                            "run on the plain weights (MKL), faster there than the prepacked "
                                            "ones; the plain weights stay in RAM beside the packed ones for it "
                                            "(0: dropped, saving that RAM)")
    cpu_one_thread_max_rows: int = option(
        1, "CPU only: forwards of at most this many tokens (batch-1 decode) run on one intra-op thread, larger "
        "ones on torch's thread count: at one row each op's parallel region cost more than it saved (measured "
        "on 2 shared cores: docs/quantization.md); 0: every forward on torch's count")
    decode_fused_gemv: int = option(
        1, "CUDA: forwards of at most this many tokens (at most 16) run each layer's projections and the "
        "LM head as Triton GEMVs, SiLU-and-mul fused into the down projection's (docs/engine.md); default 1: "
        "batch-1 decode, where they beat cuBLAS (at 4 and 8 rows cuBLAS is faster); 0: off. CPU with "
        "gguf_kernel='ggml': any value but 0 runs a one-token forward's layers as ggml graphs, one per layer boundary")
    cuda_graph_max_bs: int | None = option(None, "largest decode batch captured in a CUDA graph; default "
                                           "min(max_running_requests, 512)")
    # Extends of at most this many tokens (and min(cuda_graph_max_bs, 256) requests) replay captured
    # graphs: the short extends the radix cache and jump-forward leave.
    cuda_graph_max_extend_tokens: int = option(512, "extends of at most this many tokens replay CUDA graphs; "
                                               "0 runs every extend eagerly")
    quantization: str | None = option(
        None, "quantized weights: fp8 (e4m3 weights with per-channel scales, activations quantized per token; "
        "CUDA needs compute capability 8.9+) quantizes a bf16 checkpoint at load; a checkpoint's own "
        "quantization_config (fp8, compressed-tensors float8) is read without it; gguf (CPU): a GGUF file's "
        "Q4_0/Q4_1/Q8_0 weights stay quantized; awq, gptq: 4-bit checkpoints (read from their config without "
        "it) (docs/quantization.md)",
        choices=("fp8", "gguf", "awq", "gptq"))
    gguf_kernel: str = option(
        "torch", "with quantization gguf on the CPU, the product of the kept Q8_0/Q4_0/Q4_1 projections and LM "
        "head: torch (its int8 and int4 kernels) or ggml (llama.cpp's product on the file's blocks, on a kept "
        "threadpool of torch's thread count: faster at batch 1, and it gains from more threads there; needs the "
        "optional libggml-python: pip install 'radixlm[ggml]') (docs/quantization.md)", choices=("torch", "ggml"))
    load_format: str = option("auto", "auto: weights from the model path; dummy: random weights (benchmarks)",
                              choices=("auto", "dummy"))
    tp_size: int = option(1, "tensor-parallel ranks, one process each (docs/scale_out.md)",
                          aliases=("--tensor-parallel-size", "-tp"))
    dp_size: int = option(1, "data-parallel engine workers behind one cache-aware router (docs/scale_out.md)",
                          aliases=("--data-parallel-size", "-dp"))
    nnodes: int = option(1, "machines the tensor-parallel ranks span, tp_size / nnodes ranks on each; every "
                         "machine runs the same command with its own --node-rank (docs/scale_out.md)")
    node_rank: int = option(0, "this machine's index among --nnodes: 0 serves HTTP, the others run their ranks")
    dist_init_addr: str | None = option(None, "HOST:PORT on machine 0 where the ranks of all machines meet (needed "
                                        "with --nnodes > 1; the port must be free there and reachable)")
    scheduler_process: bool = option(False, "run the scheduler loop (model, KV pool, radix cache) in its own "
                                     "process; the front end talks to it through messages only (docs/engine.md)")
    speculative_algorithm: str | None = option(
        None, "speculative decoding (docs/speculative.md): ngram (drafts looked up in the request's own prompt and "
        "output: pays where the output repeats its input: extraction, quoting, code edits), draft (a smaller "
        "checkpoint sharing the tokenizer, speculative_draft_model_path), eagle or eagle3 (an EAGLE-1/2 or "
        "EAGLE-3 draft head, speculative_draft_model_path); None: off. Greedy outputs are unchanged "
        "and sampled ones keep the target's distribution; SGLang's upper-case names and STANDALONE (draft) are taken too")
    speculative_num_draft_tokens: int = option(
        4, "most draft tokens one verify step checks per request (the step computes this many plus one)",
        aliases=("--num-speculative-tokens",))
    speculative_ngram_min_match_window_size: int = option(
        2, "ngram: the shortest suffix of the request's tokens looked up in them", aliases=("--prompt-lookup-min",))
    speculative_ngram_max_match_window_size: int = option(
        8, "ngram: the longest suffix looked up (the longest that matches gives the draft)",
        aliases=("--prompt-lookup-max",))
    speculative_ngram_radix_cache: bool = option(
        True, "ngram: first draft what the radix cache holds after the request's whole context (another "
        "request's continuation of the same tokens: a prompt asked again, a retried call); False: the "
        "request's own n-grams only")
    speculative_ngram_max_bfs_breadth: int = option(
        1, "ngram: the most continuations one draft merges into a tree (the radix cache's, then those after "
        "earlier occurrences of the matched suffix), verified at once with a tree mask; 1: a chain")
    speculative_draft_model_path: str | None = option(
        None, "draft: the draft checkpoint (a path, .gguf or hub id) whose tokenizer is the target's; eagle: the "
        "EAGLE head's checkpoint (a path or hub id)")
    speculative_num_steps: int | None = option(
        None, "eagle, eagle3: draft steps of the head per verify step (a chain's length, a tree's depth); None: "
        "speculative_num_draft_tokens")
    speculative_eagle_topk: int = option(
        1, "eagle, eagle3: children per expanded node and nodes expanded per draft step (a tree of "
        "speculative_num_draft_tokens best nodes, speculative_num_steps deep, verified at once with a tree "
        "mask); 1: a chain")
    speculative_adaptive: bool = option(
        True, "each step drafts the lengths that give the most expected tokens per second, from each request's rate "
        "of kept draft tokens and the step times measured on the device, and none where a plain decode step does "
        "better; false: always the most that fits")

    def __post_init__(self) -> None:
        # Each value against its field's type, however the options are built (from_kwargs, the CLI, or
        # EngineOptions(...) directly).
        for f in dataclasses.fields(self):
            setattr(self, f.name, _checked_type(f.name, f.type, getattr(self, f.name)))

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> "EngineOptions":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise InvalidRequestError(f"unknown Engine option(s) {unknown}; known: {sorted(known)}", unknown[0])
        opts = cls(**kwargs)
        opts._resolve()
        return opts

    def _check_nodes(self) -> None:
        if not 0 <= self.node_rank < self.nnodes:
            raise InvalidRequestError(f"node_rank must be in [0, nnodes) (got {self.node_rank}, nnodes "
                                      f"{self.nnodes})", "node_rank")
        if self.nnodes == 1:
            return
        if self.tp_size % self.nnodes:
            raise InvalidRequestError(f"tp_size ({self.tp_size}) must be a multiple of nnodes ({self.nnodes})",
                                      "nnodes")
        host, _, port = (self.dist_init_addr or "").rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidRequestError(f"nnodes > 1 needs dist_init_addr as HOST:PORT (got {self.dist_init_addr!r})",
                                      "dist_init_addr")

    def _resolve(self) -> None:
        self.log_level = self.log_level.lower()
        if self.speculative_algorithm is not None:
            name = self.speculative_algorithm.lower()
            self.speculative_algorithm = SPECULATIVE_ALIASES.get(name, name)
        for f in dataclasses.fields(self):
            choices, value = f.metadata.get("choices"), getattr(self, f.name)
            if choices and value is not None and value not in choices:
                raise InvalidRequestError(f"{f.name} must be one of {list(choices)} (got {value!r})", f.name)
        if self.device is None:
            import torch

            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.dtype == "auto":
            self.dtype = "bfloat16" if self.device.startswith("cuda") else "float32"
        if self.enable_overlap_schedule is None:
            self.enable_overlap_schedule = (self.device.startswith("cuda") and self.tp_size == self.dp_size == 1
                                            and self.speculative_algorithm is None)
        self._check_speculative()
        if self.gguf_kernel == "ggml" and (self.quantization != "gguf" or not self.device.startswith("cpu")):
            raise InvalidRequestError("gguf_kernel='ggml' applies to quantization='gguf' on the CPU", "gguf_kernel")
        if self.max_running_requests is None:
            self.max_running_requests = 512 if self.device.startswith("cuda") else 64
        for name in ("max_running_requests", "schedule_fairness_bound", "tp_size", "dp_size", "nnodes",
                     "stream_interval", "max_requests_per_call", "prepare_workers", "max_image_bytes",
                     "max_image_pixels", "max_video_frames"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"{name} must be >= 1", name)
        if self.schedule_admission_batch < 0:
            raise InvalidRequestError("schedule_admission_batch must be >= 0", "schedule_admission_batch")
        if self.tp_size > 1 and self.dp_size > 1:
            raise InvalidRequestError("tp_size > 1 and dp_size > 1 together are not supported yet", "dp_size")
        self._check_nodes()
        if self.scheduler_process and (self.tp_size > 1 or self.dp_size > 1):
            raise InvalidRequestError("scheduler_process with tp_size or dp_size > 1 is not supported yet",
                                      "scheduler_process")
        if self.cuda_graph_max_bs is None:
            self.cuda_graph_max_bs = min(self.max_running_requests, 512)
        if self.cuda_graph_max_bs < 1:
            raise InvalidRequestError("cuda_graph_max_bs must be >= 1", "cuda_graph_max_bs")
        if self.cuda_graph_max_extend_tokens < 0:
            raise InvalidRequestError("cuda_graph_max_extend_tokens must be >= 0", "cuda_graph_max_extend_tokens")
        if not 0 <= self.decode_fused_gemv <= 16:  # kernels.GEMV_MAX_ROWS: not imported here (torch)
            raise InvalidRequestError("decode_fused_gemv must be between 0 (off) and 16 rows", "decode_fused_gemv")
        if self.cpu_plain_linear_max_rows < 0:
            raise InvalidRequestError("cpu_plain_linear_max_rows must be >= 0", "cpu_plain_linear_max_rows")
        if self.cpu_one_thread_max_rows < 0:
            raise InvalidRequestError("cpu_one_thread_max_rows must be >= 0", "cpu_one_thread_max_rows")
        if self.context_length is not None and self.context_length < 2:
            raise InvalidRequestError("context_length must be >= 2", "context_length")
        if self.max_total_tokens is not None and self.max_total_tokens < 16:
            raise InvalidRequestError("max_total_tokens must be >= 16", "max_total_tokens")
        if self.chunked_prefill_size is None or self.chunked_prefill_size <= 0:
            self.chunked_prefill_size = -1
        elif self.chunked_prefill_size < 1:
            raise InvalidRequestError("chunked_prefill_size must be positive or -1", "chunked_prefill_size")
        if self.grammar_warm_seconds < 0:
            raise InvalidRequestError("grammar_warm_seconds must be >= 0 (0: no warm-up)", "grammar_warm_seconds")
        if self.hicache_size_gb < 0:
            raise InvalidRequestError("hicache_size_gb must be >= 0 (0: no host tier)", "hicache_size_gb")
        if self.enable_overlap_schedule and self.tp_size > 1:
            # The other ranks replay the batch from its pickle: a device tensor of tokens cannot go along.
            raise InvalidRequestError("enable_overlap_schedule with tp_size > 1 is not supported yet",
                                      "enable_overlap_schedule")
        if self.hicache_size_gb > 0 and self.tp_size > 1:
            raise InvalidRequestError("hicache_size_gb with tp_size > 1 is not supported yet", "hicache_size_gb")
        if self.hicache_size_gb > 0 and self.disable_radix_cache:
            raise InvalidRequestError("hicache_size_gb is a tier of the radix cache, which disable_radix_cache "
                                      "turns off", "hicache_size_gb")
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise InvalidRequestError("mem_fraction_static must be in (0, 1)", "mem_fraction_static")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise InvalidRequestError("max_queued_requests must be >= 0 (or None: unbounded)", "max_queued_requests")
        for name in ("prepare_timeout", "stall_timeout"):
            if not getattr(self, name) > 0:
                raise InvalidRequestError(f"{name} must be > 0 seconds", name)
        if self.request_timeout is not None and not 0 < self.request_timeout < float("inf"):
            raise InvalidRequestError("request_timeout must be a number of seconds > 0", "request_timeout")

    def _check_speculative(self) -> None:
        if self.speculative_algorithm is None:
            return
        if self.speculative_algorithm not in SPECULATIVE_ALGORITHMS:
            raise InvalidRequestError(f"speculative_algorithm must be one of {list(SPECULATIVE_ALGORITHMS)} (got "
                                      f"{self.speculative_algorithm!r})", "speculative_algorithm")
        for name in ("speculative_num_draft_tokens", "speculative_ngram_min_match_window_size",
                     "speculative_ngram_max_bfs_breadth"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"{name} must be >= 1", name)
        if self.speculative_ngram_max_match_window_size < self.speculative_ngram_min_match_window_size:
            raise InvalidRequestError("speculative_ngram_max_match_window_size must be >= the min window size",
                                      "speculative_ngram_max_match_window_size")
        if self.speculative_algorithm in ("draft", "eagle", "eagle3") and not self.speculative_draft_model_path:
            raise InvalidRequestError(f"speculative_algorithm {self.speculative_algorithm} needs "
                                      "speculative_draft_model_path", "speculative_draft_model_path")
        if self.speculative_num_steps is not None and self.speculative_num_steps < 1:
            raise InvalidRequestError("speculative_num_steps must be >= 1", "speculative_num_steps")
        if self.speculative_eagle_topk < 1:
            raise InvalidRequestError("speculative_eagle_topk must be >= 1", "speculative_eagle_topk")
        trees = self.speculative_ngram_max_bfs_breadth > 1 if self.speculative_algorithm == "ngram" \
            else self.speculative_eagle_topk > 1
        if trees and self.speculative_num_draft_tokens > MAX_TREE_NODES:
            raise InvalidRequestError(f"draft trees hold at most {MAX_TREE_NODES} tokens (the attention's tree mask "
                                      "is 64 bits a row): lower speculative_num_draft_tokens",
                                      "speculative_num_draft_tokens")
        if self.enable_overlap_schedule:
            raise InvalidRequestError("enable_overlap_schedule with speculative_algorithm is not supported yet",
                                      "enable_overlap_schedule")
        if self.tp_size > 1 or self.dp_size > 1:
            raise InvalidRequestError("speculative_algorithm with tp_size or dp_size > 1 is not supported yet",
                                      "speculative_algorithm")

    @property
    def torch_dtype(self) -> "torch.dtype":
        import torch

        return getattr(torch, _DTYPES[self.dtype])

    @property
    def torch_kv_dtype(self) -> "torch.dtype":
        """The KV pool's dtype; fp8 where this torch build has it (else InvalidRequestError)."""
        import torch

        name = KV_CACHE_DTYPES[self.kv_cache_dtype]
        if name is None:
            return self.torch_dtype
        if not hasattr(torch, name):
            raise InvalidRequestError(f"kv_cache_dtype={self.kv_cache_dtype}: torch {torch.__version__} has no "
                                      f"torch.{name}", "kv_cache_dtype")
        return getattr(torch, name)
