"""Typed, frozen run configuration: schemas, YAML loading, presets, overrides.

A config is built from a preset name (`tiny`, `small`, `llama3-8b`, ...) or a
YAML file, which may name a `base:` preset/file to start from, followed by
dotted command-line overrides (`train.optimizer.lr=3e-4`). Every field carries
a docstring (pydantic turns it into the field description) so `config show`
output and the docs are self-explaining. Nothing here is global: callers pass
the resulting `Config` object down explicitly.
"""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from shipyard.errors import ConfigError


class Schema(BaseModel):
    # extra="forbid" turns a typo in a YAML key into an error instead of a
    # silently ignored setting; frozen=True keeps configs as values.
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class RopeScaling(Schema):
    """Llama-3 style RoPE frequency scaling (introduced with Llama 3.1)."""

    factor: float = Field(8.0, gt=0)
    """Divide the low frequencies by this factor."""
    low_freq_factor: float = Field(1.0, gt=0)
    """Wavelengths longer than original_max_position / low_freq_factor are fully scaled."""
    high_freq_factor: float = Field(4.0, gt=0)
    """Wavelengths shorter than original_max_position / high_freq_factor are left alone."""
    original_max_position: int = Field(8192, gt=0)
    """Context length the frequencies were originally trained for."""

    @model_validator(mode="after")
    def _check_order(self) -> RopeScaling:
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("high_freq_factor: must be greater than low_freq_factor")
        return self


class MoEConfig(Schema):
    """Mixture-of-experts MLPs: a router sends each token to `experts_per_token` of `num_experts` SwiGLU experts."""

    num_experts: int = Field(gt=1)
    """Routed experts per MoE layer (the `experts` logical axis)."""
    experts_per_token: int = Field(gt=0)
    """Top-k: experts each token is sent to."""
    expert_intermediate_size: int = Field(gt=0)
    """Hidden width of one expert's SwiGLU MLP (the `expert_mlp` logical axis)."""
    num_shared_experts: int = Field(0, ge=0)
    """Experts every token always uses (DeepSeek / Marin style), each expert_intermediate_size wide; run as one fused MLP."""
    first_dense_layers: int = Field(0, ge=0)
    """The first this many layers use a dense MLP of intermediate_size instead of experts."""
    score: Literal["softmax", "sigmoid"] = "softmax"
    """Router score per expert: softmax over experts (Mixtral) or an independent sigmoid (DeepSeek-V3)."""
    normalize_weights: bool = True
    """Rescale the chosen experts' scores to sum to 1 per token."""
    routed_scale: float = Field(1.0, gt=0)
    """Multiply the routed experts' combined output by this (DeepSeek-V3's routed_scaling_factor)."""
    capacity_factor: float | None = Field(None, gt=0)
    """null: dropless (every assignment computed). A number: each expert takes at most capacity_factor x tokens x k / num_experts tokens per routing group (the tokens of one expert-parallel group) and drops the rest, earliest tokens first."""
    aux_loss: float = Field(0.01, ge=0)
    """Coefficient of the Switch load-balancing loss, num_experts x sum_i (fraction routed to i) x (mean score of i), summed over MoE layers; 0 disables."""
    router_z_loss: float = Field(0.001, ge=0)
    """Coefficient of the router z-loss (mean squared logsumexp of router logits), summed over MoE layers; 0 disables."""
    bias_update_rate: float = Field(0.0, ge=0)
    """Auxiliary-loss-free balancing (DeepSeek-V3): after each step every expert's selection bias moves by this much toward equal load (up if under-loaded); 0 disables."""
    grouped_matmul: Literal["auto", "ragged", "blocked"] = "auto"
    """Dropless expert matmul: ragged (jax.lax.ragged_dot: XLA:TPU's grouped-matmul kernel; XLA:CPU and XLA:GPU run every local expert on every row), blocked (tokens padded into per-expert blocks and one batched matmul), auto: ragged on TPU, blocked on CPU and GPU (docs/targets.md has the compiled costs)."""

    @model_validator(mode="after")
    def _check_topk(self) -> MoEConfig:
        if self.experts_per_token > self.num_experts:
            raise ValueError(
                f"experts_per_token: {self.experts_per_token} exceeds num_experts={self.num_experts}"
            )
        return self


class ModelConfig(Schema):
    """A dense decoder-only transformer of the Llama-3 family."""

    vocab_size: int = Field(gt=0)
    """Number of token ids (rows of the embedding table)."""
    hidden_size: int = Field(gt=0)
    """Width of the residual stream (the `embed` logical axis)."""
    intermediate_size: int = Field(gt=0)
    """Width of the SwiGLU MLP hidden layer (the `mlp` logical axis)."""
    num_layers: int = Field(gt=0)
    """Number of transformer blocks, stacked on the leading `layers` axis."""
    num_heads: int = Field(gt=0)
    """Number of query heads."""
    num_kv_heads: int = Field(gt=0)
    """Number of key/value heads (grouped-query attention); must divide num_heads."""
    head_dim: int | None = Field(None, gt=0)
    """Width of one attention head; filled in as hidden_size / num_heads when omitted."""
    max_seq_len: int = Field(2048, gt=0)
    """Longest sequence the model is configured for (RoPE tables are built to this length)."""
    rope_theta: float = Field(10000.0, gt=0)
    """RoPE base frequency (Llama 3 uses 500000)."""
    rope_scaling: RopeScaling | None = None
    """Optional Llama-3 frequency scaling; null means plain RoPE."""
    norm_eps: float = Field(1e-5, gt=0)
    """Epsilon inside RMSNorm's square root."""
    qk_norm: bool = False
    """Apply RMSNorm to queries and keys per head before RoPE (OLMo-2 / Qwen-3 style)."""
    sliding_window: int | None = Field(None, gt=0)
    """Local attention: a token sees at most this many positions (itself included); null attends to the whole prefix."""
    global_attention_every: int | None = Field(None, gt=0)
    """With sliding_window: every this-many-th layer (layers n-1, 2n-1, ...) attends globally, the rest locally; null: every layer is local (Mistral)."""
    qkv_bias: bool = False
    """Learned biases on the query, key and value projections (Qwen2 style); the output projection has none."""
    tie_embeddings: bool = False
    """Use the embedding table (transposed) as the output head instead of a separate matrix."""
    init_std: float = Field(0.02, gt=0)
    """Standard deviation of the normal initialiser for embeddings and input projections."""
    remat: Literal["none", "full", "save_dots"] = "full"
    """Activation rematerialisation per block: none (keep all), full (recompute all), save_dots (keep matmul outputs)."""
    scan_unroll: int = Field(1, gt=0)
    """Layers per lax.scan iteration on the CPU backend; >= num_layers unrolls fully (faster on CPU for shallow models, slower to compile deep ones). Other backends always run the rolled scan (1), whatever this says."""
    attention_impl: Literal["auto", "reference", "ordered", "blocked", "cudnn", "splash"] = "auto"
    """Training attention core: reference (scores and softmax over the whole [seq, seq] matrix), ordered (reference's math with every sum over keys taken in key order: on CPU the serving engine's cached steps then give each query the full forward's bits; `shipyard rl` uses it there, and the engine's steps follow it), blocked (flash-style online softmax over attention_block tiles in plain JAX, any backend, memory linear in seq), cudnn (cuDNN flash attention via jax.nn.dot_product_attention: GPU, bf16/fp16, no segment ids), splash (Pallas splash attention: TPU); auto picks cudnn on GPU and splash on TPU where they apply, else blocked, and on CPU reference for short sequences (blocked from model.attention.BLOCKED_FROM_SEQ tokens)."""
    attention_block: int = Field(512, gt=0)
    """Query and key tile length of blocked (and splash) attention; sequences that are not a multiple are padded up to one."""
    moe: MoEConfig | None = None
    """Mixture-of-experts MLPs; null means every layer has the dense SwiGLU MLP."""

    @model_validator(mode="before")
    @classmethod
    def _default_head_dim(cls, data: Any) -> Any:
        # head_dim is optional in YAML but always explicit in the resolved
        # config, so `config show` tells the whole truth.
        if isinstance(data, dict) and data.get("head_dim") is None:
            hidden, heads = data.get("hidden_size"), data.get("num_heads")
            if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
                if hidden % heads:
                    raise ValueError(
                        f"num_heads: {heads} does not divide hidden_size={hidden}; "
                        "choose divisible sizes or set head_dim explicitly"
                    )
                data = {**data, "head_dim": hidden // heads}
        return data

    @model_validator(mode="after")
    def _check_heads(self) -> ModelConfig:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads: {self.num_kv_heads} does not divide num_heads={self.num_heads}; "
                "expected a divisor of num_heads"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim: {self.head_dim} must be even for RoPE")
        if self.moe is not None and self.moe.first_dense_layers >= self.num_layers:
            raise ValueError(
                f"moe.first_dense_layers: {self.moe.first_dense_layers} leaves no MoE layer of "
                f"num_layers={self.num_layers}; use fewer dense layers or moe: null"
            )
        return self

    @property
    def num_dense_layers(self) -> int:
        """Layers with a dense MLP (all of them without MoE)."""
        return self.num_layers if self.moe is None else self.moe.first_dense_layers

    @property
    def num_moe_layers(self) -> int:
        """Layers with a mixture-of-experts MLP."""
        return self.num_layers - self.num_dense_layers


class MixtureComponent(Schema):
    """One weighted source of training sequences."""

    path: str
    """A token-shard directory (from `shipyard data tokenize`) or a 1-D .npy of token ids."""
    weight: float = Field(gt=0)
    """Relative share of training sequences drawn from this source (weights are normalised)."""


class ChatDataConfig(Schema):
    """Chat conversations for supervised fine-tuning (SFT), rendered with a chat template and packed."""

    train: str
    """JSONL file, one conversation per line: {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}."""
    validation: str | None = None
    """Held-out conversations (same format) for the in-loop val_loss (train.eval_every), on assistant tokens only."""
    tokenizer: str | None = None
    """tokenizer.json (or a directory holding one); null takes the tokenizer of train.init_from (a run or an `import hf` directory)."""
    template: Literal["auto", "hf", "shipyard", "chatml", "llama3"] = "auto"
    """Chat template: hf (the tokenizer's own Hugging Face Jinja template: chat_template in tokenizer_config.json or chat_template.jinja), shipyard (<|system|>/<|user|>/<|assistant|> ... <|end|>), chatml (<|im_start|>role ... <|im_end|>), llama3 (<|start_header_id|>role<|end_header_id|> ... <|eot_id|>); auto picks hf when the tokenizer has a template, else the built-in whose special tokens it has."""
    pack: bool = True
    """Pack several conversations into each sequence (attention and positions restart at each one); false: one conversation per sequence, padded."""


class PreferenceDataConfig(Schema):
    """Preference pairs for DPO / SimPO / ORPO: a prompt, a preferred and a dispreferred reply, rendered with a chat template."""

    train: str
    """JSONL file, one pair per line: {"prompt": "..." | "messages": [...], "chosen": "...", "rejected": "..."} (messages end with a user turn; replies are the assistant's next turn)."""
    validation: str | None = None
    """Held-out pairs (same format) for the in-loop preference metrics (train.eval_every)."""
    tokenizer: str | None = None
    """tokenizer.json (or a directory holding one); null takes the tokenizer of train.init_from."""
    template: Literal["auto", "hf", "shipyard", "chatml", "llama3"] = "auto"
    """Chat template the pairs are rendered with (as data.chat.template)."""
    pack: bool = True
    """Pack several pairs into each sequence (each reply attends to its own prompt only); false: one pair per sequence."""


class DataConfig(Schema):
    """Where training tokens come from and how sequences are cut."""

    train_tokens: str | None = None
    """A token-shard directory (from `shipyard data tokenize` / `data prepare`) or a 1-D .npy of token ids (from `shipyard data bytes`)."""
    mixture: tuple[MixtureComponent, ...] = ()
    """Several weighted sources instead of train_tokens, e.g. [{path: dclm, weight: 0.926}, {path: code, weight: 0.061}, ...]."""
    validation_tokens: str | None = None
    """Held-out tokens (shard directory or .npy) for the in-loop evaluation (train.eval_every)."""
    seq_len: int = Field(gt=0)
    """Tokens per training sequence (each sample reads seq_len + 1 tokens for the shifted targets)."""
    document_masking: bool = False
    """Attention does not cross an EOS inside a packed sequence (segment ids from the EOS positions)."""
    eos_id: int | None = Field(None, ge=0)
    """EOS token id for document_masking; null takes it from the token shards' manifest (required for a .npy)."""
    seed: int | None = None
    """Seed of the data order only (shuffle, mixture, chat packing); null uses train.seed, so runs from before this field keep their batches and hashes. Set it to reshuffle the data with the same initialisation."""
    verify: bool = True
    """Check each token shard's sha256 against its manifest before training (hashed once per shard, then remembered per user until the file changes); false skips the hashes (byte sizes are always checked) and is recorded in provenance.json."""
    chat: ChatDataConfig | None = None
    """Chat conversations (SFT) instead of token shards: loss on assistant tokens only; set train_tokens and mixture to null."""
    preference: PreferenceDataConfig | None = None
    """Preference pairs (DPO / SimPO / ORPO, with train.preference) instead of token shards or chats; set train_tokens and mixture to null."""

    @model_validator(mode="after")
    def _check_sources(self) -> DataConfig:
        if self.train_tokens is not None and self.mixture:
            raise ValueError("mixture: set either train_tokens or mixture, not both")
        if self.chat is not None and (self.train_tokens is not None or self.mixture):
            raise ValueError(
                "chat: SFT trains on chat conversations only; set data.train_tokens: null and data.mixture: []"
            )
        if self.preference is not None and (self.train_tokens is not None or self.mixture or self.chat):
            raise ValueError(
                "preference: preference tuning trains on preference pairs only; set data.train_tokens: null, "
                "data.mixture: [] and data.chat: null"
            )
        return self

    def sources(self) -> tuple[list[str], list[float]]:
        """(paths, weights) of the training sources."""
        if self.mixture:
            return [c.path for c in self.mixture], [c.weight for c in self.mixture]
        return ([self.train_tokens] if self.train_tokens is not None else []), [1.0]


class OptimizerConfig(Schema):
    """Gradient clipping, then AdamW (or Muon for matrices), scaled by the schedule."""

    name: Literal["adamw", "muon"] = "adamw"
    """adamw for every parameter, or muon for hidden matrices with AdamW for the rest."""
    lr: float = Field(3e-4, gt=0)
    """Peak learning rate (for muon: the learning rate of the matrix parameters)."""
    b1: float = Field(0.9, ge=0, lt=1)
    """AdamW first-moment decay."""
    b2: float = Field(0.95, ge=0, lt=1)
    """AdamW second-moment decay."""
    eps: float = Field(1e-8, gt=0)
    """AdamW denominator epsilon."""
    weight_decay: float = Field(0.1, ge=0)
    """Decoupled weight decay (multiplied by the scheduled learning rate)."""
    decay_embeddings: bool = False
    """Also decay the embedding table (off by default, as in Llama and Marin recipes)."""
    decay_norms: bool = False
    """Also decay RMSNorm scales (off by default)."""
    clip_norm: float | None = Field(1.0, gt=0)
    """Clip gradients to this global L2 norm; null disables clipping."""
    muon_adam_lr: float | None = Field(None, gt=0)
    """With muon: peak learning rate of the AdamW part (embeddings, head, norms); null means lr."""
    muon_momentum: float = Field(0.95, ge=0, lt=1)
    """With muon: momentum of the orthogonalised update."""
    muon_ns_steps: int = Field(5, gt=0)
    """With muon: Newton-Schulz iterations per update."""


class ScheduleConfig(Schema):
    """Learning-rate schedule as a function of the training step."""

    kind: Literal["constant", "cosine", "wsd"] = "cosine"
    """constant; cosine (warmup then cosine decay to the floor); wsd (warmup, stable, decay)."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warmup from 0 to the peak rate; the main schedule starts at the peak, so there is no jump."""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """Floor of the decay as a fraction of the peak rate."""
    decay_fraction: float = Field(0.2, gt=0, le=1)
    """wsd only: fraction of all steps spent in the final linear decay."""


class PrecisionConfig(Schema):
    """Mixed precision: params stay fp32; matmuls run in compute_dtype."""

    compute_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of activations and matmuls; the loss is always computed in fp32."""
    matmul: Literal["compute_dtype", "fp8"] = "compute_dtype"
    """fp8: the attention and MLP matmuls run in float8 (e4m3 operands, e5m2 gradients, per-tensor current scaling; model/fp8.py), at twice the bf16 peak on H100/H200; refused on TPU. `train.precision=fp8` sets this with compute_dtype bfloat16."""
    loss_scale_init: float = Field(2.0**15, gt=0)
    """float16 only: initial dynamic loss scale."""
    loss_scale_growth_interval: int = Field(1000, gt=0)
    """float16 only: double the loss scale after this many consecutive finite steps."""


PRECISION_SHORTHANDS = {
    "fp32": {"compute_dtype": "float32"},
    "bf16": {"compute_dtype": "bfloat16"},
    "fp16": {"compute_dtype": "float16"},
    "fp8": {"compute_dtype": "bfloat16", "matmul": "fp8"},
}
"""What `train.precision=NAME` stands for."""


class WandbConfig(Schema):
    """Weights & Biases logging (needs `pip install 'shipyard[wandb]'`)."""

    project: str
    """W&B project the run is logged to."""
    entity: str | None = None
    """W&B user or team; null uses the logged-in default."""
    mode: Literal["online", "offline"] = "offline"
    """offline writes <run>/wandb for a later `wandb sync` (no network or account needed); online streams."""


class LoggingConfig(Schema):
    """What is recorded and shown while training."""

    log_every: int = Field(10, gt=0)
    """Write a metrics.jsonl line every this many steps (and at the last step)."""
    progress: bool = True
    """Show a live progress bar with loss, tokens/s and ETA."""
    peak_flops_per_device: float | None = Field(None, gt=0)
    """Peak FLOP/s of one device for MFU; null measures a matmul peak on CPU."""
    tensorboard: bool = True
    """Also write every metric as TensorBoard scalars under <run>/tb (`tensorboard --logdir runs/`)."""
    wandb: WandbConfig | None = None
    """Also log every metric to Weights & Biases; null disables."""


class CheckpointConfig(Schema):
    """Saving the full train state (params, optimizer state, step, loss scale) with Orbax."""

    every: int | None = Field(1000, gt=0)
    """Save every this many steps into <run>/checkpoints/<step>; null disables periodic saves."""
    save_final: bool = True
    """Also save after the last step."""
    keep: int | None = Field(3, gt=0)
    """Keep only the newest this many checkpoints (plus the permanent ones); null keeps all."""
    keep_every: int | None = Field(None, gt=0)
    """Also keep every checkpoint whose step is a multiple of this, permanently; null keeps none beyond `keep`."""


class LoraConfig(Schema):
    """Low-rank adapters: W x becomes W x + (alpha / rank) B A dropout(x), with W frozen."""

    rank: int = Field(8, gt=0)
    """Rank r of each adapter (A: [in, r], B: [r, out])."""
    alpha: float = Field(16.0, gt=0)
    """Scaling numerator: the adapter's output is multiplied by alpha / rank."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input during training (not on the frozen path); 0 disables."""
    targets: tuple[Literal["q", "k", "v", "o", "gate", "up", "down"], ...] = ("q", "k", "v", "o")
    """Projections that get adapters: attention q, k, v, o and dense MLP gate, up, down (MoE experts get none)."""

    @model_validator(mode="after")
    def _check_targets(self) -> LoraConfig:
        if not self.targets or len(set(self.targets)) != len(self.targets):
            raise ValueError(
                f"targets: expected distinct names from q, k, v, o, gate, up, down (got {list(self.targets)})"
            )
        return self


class PreferenceConfig(Schema):
    """Preference tuning on data.preference pairs: DPO against a frozen reference, or reference-free SimPO or ORPO."""

    loss: Literal["dpo", "simpo", "orpo"] = "dpo"
    """dpo: -log sigmoid(beta [(pi_c - ref_c) - (pi_r - ref_r)]) on summed reply log-probs (Rafailov et al., 2023); simpo: -log sigmoid(beta (pi_c / |c| - pi_r / |r|) - gamma) on length-normalised log-probs, no reference (Meng et al., 2024); orpo: the chosen reply's per-token NLL - beta log sigmoid(log odds_c - log odds_r), odds of the mean token probability, no reference (Hong et al., 2024)."""
    beta: float = Field(0.1, gt=0)
    """Inverse temperature of the implicit reward (DPO: 0.1 typical; SimPO: 2.0 typical); ORPO: the weight lambda of its odds-ratio term (0.1 typical)."""
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    """Conservative DPO (and SimPO): the assumed probability that a pair's labels are flipped (0 is the plain loss); ORPO has none."""
    gamma: float = Field(0.5, ge=0)
    """SimPO's target reward margin (ignored by dpo and orpo)."""
    reference: Literal["cached", "on_the_fly"] = "cached"
    """dpo: cached computes the reference log-probs of every pair once before step 0 and stores them in the run directory (reused on resume); on_the_fly runs the frozen reference forward in every step."""

    @model_validator(mode="after")
    def _check_smoothing(self) -> PreferenceConfig:
        if self.loss == "orpo" and self.label_smoothing:
            raise ValueError(
                f"label_smoothing: {self.label_smoothing} does not apply to orpo (its loss has no flipped-label "
                "term); set it to 0 or use loss: dpo / simpo"
            )
        return self


class FinetuneConfig(Schema):
    """What trains: LoRA adapters on a frozen model, or only the last layers; the rest stays bitwise fixed."""

    lora: LoraConfig | None = None
    """Train low-rank adapters only; the base params are frozen and hold no optimizer state."""
    train_last_layers: int | None = Field(None, gt=0)
    """Train only the last this many transformer blocks (plus the final norm and untied head, see train_head); earlier layers and the embedding are frozen and get no backward pass."""
    train_head: bool = True
    """With train_last_layers: also train the final norm and the output head (a tied head is the embedding and stays frozen)."""
    quantize_base: Literal["nf4", "int8"] | None = None
    """QLoRA: hold the frozen base quantized on the device (nf4: 4-bit NormalFloat, blockwise absmax; int8: per output channel), quantized once at the start and dequantized inside each matmul; needs lora."""
    quant_block: int = Field(64, gt=0)
    """nf4: weights per absmax block."""
    double_quant: bool = False
    """nf4: also quantize the blocks' fp32 absmax scales to 8 bits (blocks of 256), as QLoRA's double quantization."""

    @model_validator(mode="after")
    def _check_one(self) -> FinetuneConfig:
        if self.lora is not None and self.train_last_layers is not None:
            raise ValueError("lora: choose LoRA or train_last_layers, not both")
        if self.quantize_base is not None and self.lora is None:
            raise ValueError(
                f"quantize_base: {self.quantize_base} quantizes the frozen base for QLoRA; set lora too"
            )
        if self.lora is None and self.train_last_layers is None:
            raise ValueError(
                "lora: set lora or train_last_layers (or leave train.finetune null for full training)"
            )
        return self


class OffloadConfig(Schema):
    """What of the train state lives in host memory between steps (memory_kind pinned_host), streamed to the device for the step."""

    optimizer: bool = False
    """Keep the optimizer state (AdamW's moments: 8 bytes per trained parameter) in pinned host memory; each step copies it to the device for the update and back."""
    params: bool = False
    """Also keep the fp32 master params in pinned host memory; each step copies them to the device for the forward pass and the update, and back."""


class PipelineConfig(Schema):
    """The pipeline schedule over mesh.pipeline stages (parallel/pipeline.py): each step's batch flows through the stages in microbatches."""

    microbatches: int = Field(gt=0)
    """Microbatches each step's batch (per train.microbatches slice) is split into; their gradients add up to the whole batch's. More microbatches shrink the bubble, (pipeline - 1) / (microbatches x repeats + pipeline - 1)."""
    repeats: int = Field(1, gt=0)
    """Rounds of the circular schedule: each stage holds this many non-contiguous chunks of layers and every microbatch circles the stages this many times (1: GPipe). Needs microbatches >= mesh.pipeline when above 1, and num_layers (the MoE layers, for a MoE model) divisible by pipeline x repeats."""


class TrainConfig(Schema):
    """The optimisation loop."""

    steps: int = Field(gt=0)
    """Number of optimizer steps to run."""
    global_batch_size: int = Field(gt=0)
    """Sequences per step across all devices."""
    microbatches: int = Field(1, gt=0)
    """Split each step's batch into this many sequential microbatches (gradient accumulation)."""
    pipeline: PipelineConfig | None = None
    """The pipeline schedule (microbatches, repeats) when mesh.pipeline > 1 splits the layers into stages; also runs on one stage (the same microbatched forward). null: no pipeline schedule."""
    seed: int = 0
    """Seed for parameter initialisation and dropout, and for the data order unless data.seed is set."""
    z_loss: float = Field(0.0, ge=0)
    """Coefficient of the z-loss (logsumexp squared) that keeps output logits small; 0 disables it."""
    loss_chunk_tokens: int | None = Field(2048, gt=0)
    """A device whose microbatch holds more tokens than this computes the output head and cross-entropy in chunks of at most this many tokens (custom VJP: the fp32 [tokens, vocab] logits never exist whole, for one more head matmul per chunk in the backward pass); at most this many, it computes the logits whole as before. The default keeps a chunk's logits near 1 GiB at a 128K vocabulary and the small CPU presets (2048 tokens per step) on the whole, faster path; null: always whole."""
    offload: OffloadConfig = OffloadConfig()
    """Host-memory offload of the optimizer state and the master params."""
    max_consecutive_nonfinite: int = Field(5, gt=0)
    """Stop the run after this many consecutive steps with a non-finite loss or gradient."""
    optimizer: OptimizerConfig = OptimizerConfig()
    """Optimizer settings."""
    schedule: ScheduleConfig = ScheduleConfig()
    """Learning-rate schedule."""
    precision: PrecisionConfig = PrecisionConfig()
    """Precision policy."""
    logging: LoggingConfig = LoggingConfig()
    """Metrics and progress display."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    """Checkpoint saving."""
    init_from: str | None = None
    """Start from these params instead of a random init: a run directory (its newest checkpoint) or the output of `shipyard import hf`; optimizer state starts fresh."""
    finetune: FinetuneConfig | None = None
    """Parameter-efficient fine-tuning (LoRA, or only the last layers); null trains every parameter."""
    preference: PreferenceConfig | None = None
    """Preference tuning (DPO / SimPO / ORPO) on data.preference instead of next-token loss; null: next-token training."""
    resize_vocab: bool = False
    """With train.init_from and a different tokenizer or model.vocab_size: resize the base's embedding (and untied head) to model.vocab_size, copying bitwise the rows of tokens whose strings both tokenizers hold and starting the others (new tokens, padding) at the mean of the base's token rows. Full fine-tuning only (train.finetune: null). Without it a vocabulary mismatch is refused."""
    eval_every: int | None = Field(None, gt=0)
    """Every this many steps (and after the last), log val_loss on data.validation_tokens; null disables."""
    eval_batches: int = Field(4, gt=0)
    """Batches of global_batch_size sequences in each evaluation (the same held-out sequences every time)."""

    @model_validator(mode="before")
    @classmethod
    def _precision_shorthand(cls, data: Any) -> Any:
        # `train.precision=fp8` (or bf16, fp16, fp32): the whole policy by one name.
        if isinstance(data, dict) and isinstance(data.get("precision"), str):
            named = PRECISION_SHORTHANDS.get(data["precision"].strip().lower())
            if named is None:
                raise ValueError(
                    f"precision: {data['precision']!r} is not a precision; expected "
                    f"{', '.join(PRECISION_SHORTHANDS)} or a mapping (compute_dtype, matmul, ...)"
                )
            data = {**data, "precision": named}
        return data

    @model_validator(mode="after")
    def _check_batch(self) -> TrainConfig:
        if self.global_batch_size % self.microbatches:
            raise ValueError(
                f"microbatches: {self.microbatches} does not divide global_batch_size={self.global_batch_size}"
            )
        return self


MESH_AXIS_NAMES = ("pipeline", "data", "fsdp", "context", "tensor", "expert")
"""The mesh axes, outermost first: pipeline stages span the slowest links (across hosts), tensor and
expert the fastest (parallel/mesh.py builds the device grid in this order)."""


class MeshConfig(Schema):
    """Device mesh axis sizes; -1 means "all remaining devices" (at most one axis)."""

    pipeline: int = 1
    """Pipeline parallelism: the stacked layers split into this many stages (train.pipeline: the schedule)."""
    data: int = -1
    """Pure data parallelism (params replicated)."""
    fsdp: int = 1
    """Fully sharded data parallelism (params sharded on `embed`, batch split too)."""
    context: int = 1
    """Context (sequence) parallelism: each sequence split along `seq`, attention as a ring over this axis."""
    tensor: int = 1
    """Tensor parallelism over heads, MLP width and vocabulary."""
    expert: int = 1
    """Expert parallelism (mixture-of-experts models)."""
    rules: dict[str, tuple[str, ...]] = {}
    """Logical axis -> mesh axes, overriding entries of the default table (parallel/mesh.py), e.g. {embed: [], mlp: [tensor, fsdp]}."""

    @model_validator(mode="after")
    def _check_rules(self) -> MeshConfig:
        for name, axes in self.rules.items():
            bad = [a for a in axes if a not in MESH_AXIS_NAMES]
            if bad:
                raise ValueError(
                    f"rules: {name} names unknown mesh axes {bad}; use {', '.join(MESH_AXIS_NAMES)}"
                )
        return self

    @model_validator(mode="after")
    def _check_sizes(self) -> MeshConfig:
        sizes = [getattr(self, a) for a in MESH_AXIS_NAMES]
        if any(s == 0 or s < -1 for s in sizes):
            raise ValueError(
                f"axis sizes must be positive or -1 (got {sizes} for {', '.join(MESH_AXIS_NAMES)})"
            )
        if sizes.count(-1) > 1:
            raise ValueError("at most one mesh axis may be -1")
        return self


class DistributedConfig(Schema):
    """Joining a multi-process JAX cluster (several hosts, or `shipyard launch --processes N`).

    Unset fields come from SHIPYARD_COORDINATOR / SHIPYARD_NUM_PROCESSES /
    SHIPYARD_PROCESS_ID, else from what JAX detects (SLURM, Open MPI, cloud TPU);
    with none of these the run is single-process.
    """

    coordinator_address: str | None = None
    """host:port of process 0's coordination service."""
    num_processes: int | None = Field(None, gt=0)
    """Number of processes in the cluster."""
    process_id: int | None = Field(None, ge=0)
    """This process's index, 0..num_processes-1."""
    initialization_timeout: int = Field(300, gt=0)
    """Seconds to wait for every process to join."""


class RunConfig(Schema):
    """Where the run directory goes."""

    name: str = "run"
    """Run name; the run directory is out_dir/name."""
    out_dir: str = "runs"
    """Parent directory of run directories."""


class Config(Schema):
    """Everything needed to reproduce a training run."""

    run: RunConfig = RunConfig()
    """Run naming and location."""
    model: ModelConfig
    """Model architecture."""
    data: DataConfig
    """Training data."""
    train: TrainConfig
    """Optimisation loop."""
    mesh: MeshConfig = MeshConfig()
    """Device mesh."""
    distributed: DistributedConfig = DistributedConfig()
    """Multi-process cluster membership."""

    def data_seed(self) -> int:
        """The seed of the data order: data.seed, or train.seed when it is null (the order before data.seed existed)."""
        return self.train.seed if self.data.seed is None else self.data.seed

    @model_validator(mode="after")
    def _check_eval(self) -> Config:
        chat_val = any(
            d is not None and d.validation is not None for d in (self.data.chat, self.data.preference)
        )
        if self.train.eval_every is not None and self.data.validation_tokens is None and not chat_val:
            raise ValueError(
                "train.eval_every: set data.validation_tokens (or data.chat.validation, data.preference.validation) to evaluate on, "
                "or leave eval_every null"
            )
        return self

    @model_validator(mode="after")
    def _check_preference(self) -> Config:
        has_pairs, has_loss = self.data.preference is not None, self.train.preference is not None
        if has_pairs != has_loss:
            raise ValueError(
                "train.preference: preference tuning needs both data.preference (the pairs) and "
                "train.preference (the loss); set both or neither"
            )
        return self

    @model_validator(mode="after")
    def _check_finetune(self) -> Config:
        ft, layers = self.train.finetune, self.model.num_layers
        if ft is not None and ft.train_last_layers is not None and ft.train_last_layers > layers:
            raise ValueError(
                f"train.finetune.train_last_layers: {ft.train_last_layers} exceeds model.num_layers={layers}"
            )
        return self

    @model_validator(mode="after")
    def _check_lengths(self) -> Config:
        if self.data.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"data.seq_len: {self.data.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}"
            )
        return self


# ----------------------------------------------------------------------------- loading

PRESET_DIR = "presets"


def preset_names() -> list[str]:
    """Names of the presets shipped inside the package."""
    files = resources.files("shipyard").joinpath(PRESET_DIR).iterdir()
    return sorted(f.name[: -len(".yaml")] for f in files if f.name.endswith(".yaml"))


def read_yaml(text: str, where: str) -> dict:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        pos = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        # a reader error (a control character) has no `problem` and a multi-line str: fold it to one line
        what = " ".join(str(getattr(e, "problem", None) or e).split())
        raise ConfigError(f"{where}: not valid YAML{pos}: {what}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a YAML mapping at top level, got {type(data).__name__}")
    return data


def _load_source(source: str, seen: tuple[str, ...] = ()) -> dict:
    """Raw dict for a preset name or YAML path, with its `base:` chain merged in."""
    if source in seen:
        raise ConfigError(f"config {source!r}: `base:` chain loops ({' -> '.join(seen + (source,))})")
    path = Path(source)
    if path.is_file():
        try:
            text = path.read_text()
        except OSError as e:
            raise ConfigError(f"config file {source}: cannot read: {e.strerror}") from e
        data = read_yaml(text, f"config file {source}")
    elif source in preset_names():
        text = resources.files("shipyard").joinpath(PRESET_DIR, f"{source}.yaml").read_text()
        data = read_yaml(text, f"preset {source}")
    else:
        raise ConfigError(
            f"config {source!r}: no such file and no preset of that name "
            f"(presets: {', '.join(preset_names())})"
        )
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(f"config {source!r}: `base` must be a preset name or file path")
    if not Path(base).is_absolute() and path.is_file() and (path.parent / base).is_file():
        base = str(path.parent / base)
    return _deep_merge(_load_source(base, seen + (source,)), data)


def _deep_merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `a.b.c=value` strings; values are parsed as YAML scalars/lists."""
    data = _deep_merge({}, data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override {item!r}: expected dotted.key=value, e.g. train.optimizer.lr=3e-4")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: value is not valid YAML") from e
        node = data
        parts = key.split(".")
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                where = ".".join(parts[: depth + 1])
                raise ConfigError(f"override {item!r}: {where} is a value, not a section")
            else:
                child = node[part] = dict(child)
            node = child
        node[parts[-1]] = value
    return data


class RLConfig(Schema):
    """`shipyard rl`: reinforcement learning from verifiable rewards (GRPO / Dr. GRPO / DAPO, rl/loss.py), rollouts from the serving engine."""

    task: Literal["add", "multiply", "reverse", "sort", "code"] | None = "add"
    """A built-in task generated locally with an exact checker (rl/tasks.py); null with `prompts`."""
    digits: int = Field(2, ge=1, le=9)
    """The built-in task's size: numbers of up to this many digits (letters: up to this many + 1)."""
    prompts: str | None = None
    """A JSONL prompt file instead of a task: one object per line with "prompt" (or "messages") and the fields `reward` reads."""
    reward: str | None = None
    """The reward function of `prompts`: module:function or path/to/file.py:function, called (prompt, completion, metadata) -> float."""
    steps: int = Field(20, gt=0)
    """Rollout batches, each followed by `updates_per_batch` optimizer steps."""
    prompts_per_step: int = Field(8, gt=0)
    """Prompts per rollout batch (N); each gets `group_size` replies."""
    group_size: int = Field(8, ge=2)
    """Replies per prompt (G): the group whose mean reward is each reply's baseline (2 at least: one reply has no baseline)."""
    max_tokens: int = Field(16, gt=0)
    """New tokens per reply at most; a reply cut there is overlong (see `overlong`)."""
    temperature: float = Field(1.0, gt=0, le=2.0)
    """Rollout temperature; the trainer's log-probs use the same (inference/sampling.py: sampling_logits)."""
    top_k: int = Field(0, ge=0)
    """Rollout top-k (0: every token), applied identically in the trainer's log-probs."""
    top_p: float = Field(1.0, gt=0, le=1.0)
    """Rollout nucleus mass (1: every token), applied identically in the trainer's log-probs."""
    lr: float = Field(3e-5, gt=0)
    """AdamW learning rate (constant)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    grad_clip: float | None = Field(1.0, gt=0)
    """Clip the gradient's global norm to this; null: no clipping."""
    advantage: Literal["group_std", "group_mean"] = "group_std"
    """group_std: (r - mean) / (std + 1e-4) within each group (GRPO); group_mean: r - mean (Dr. GRPO)."""
    aggregation: Literal["sequence", "token", "constant"] = "token"
    """sequence: mean over each reply's tokens, then over replies (GRPO); token: over all tokens of the batch (DAPO); constant: sum over tokens / (replies x max_tokens) (Dr. GRPO)."""
    clip_low: float = Field(0.2, ge=0, lt=1)
    """The ratio's lower clip: 1 - clip_low."""
    clip_high: float = Field(0.28, ge=0)
    """The ratio's upper clip: 1 + clip_high (DAPO's clip-higher: above clip_low lets unlikely tokens rise)."""
    beta: float = Field(0.0, ge=0)
    """Coefficient of the k3 KL to the starting model (0: no reference copy is kept)."""
    updates_per_batch: int = Field(1, gt=0)
    """Optimizer steps on each rollout batch (the first is exactly on-policy: ratio 1)."""
    dynamic_sampling: bool = True
    """Drop groups whose rewards are all equal (no advantage, no gradient) and refill the batch with new prompts (DAPO)."""
    max_refills: int = Field(3, ge=0)
    """With dynamic_sampling: rounds of new prompts drawn to refill a batch before training on what it has."""
    overlong: Literal["mask", "penalty", "keep"] = "mask"
    """A reply cut at max_tokens without ending: mask (left out of the loss), penalty (its reward plus overlong_penalty) or keep."""
    overlong_penalty: float = -1.0
    """Added to an overlong reply's reward with overlong: penalty."""
    eval_prompts: int = Field(64, ge=0)
    """Held-out prompts (never trained on) scored before the first batch and every eval_every steps: mean reward, pass@1 (greedy) and pass@k."""
    eval_every: int = Field(5, gt=0)
    """Steps between held-out evaluations (and after the last)."""
    pass_k: int = Field(4, ge=1)
    """k of pass@k: a held-out prompt passes when any of k sampled replies is right (reward >= 1)."""
    max_batch: int = Field(64, gt=0)
    """Cache rows of the rollout engine (replies decoded at once)."""
    shared_prefill: bool = True
    """The G replies of a prompt share one prefill (the engine's n-samples path); false prefills each alone (bench/rl_throughput.py measures the difference)."""
    save_every: int = Field(10, gt=0)
    """Steps between saved states (OUT/state/: params and optimizer state, the last 2 kept); rerunning the same command resumes from the newest, bitwise."""
    seed: int = 0
    """Seed of the prompts drawn, the replies sampled and the held-out set; a resumed run draws the same."""
    reward_timeout: float = Field(10.0, gt=0)
    """Seconds a prompt file's reward function may take on one reply; past it the reply's reward is 0, counted as "timeout" in reward_failures."""
    finetune: FinetuneConfig | None = None
    """What trains: null, every parameter; {lora: {rank: 8}} low-rank adapters on the frozen model (the engine takes the merged weights after each update; the KL reference is the frozen model with the starting adapters, so no second copy); {train_last_layers: N} the last N layers."""
    mesh: MeshConfig | None = None
    """The trainer's device mesh, e.g. {data: 2, fsdp: 4}: params sharded over fsdp, each batch split over data x fsdp (prompts_per_step x group_size must divide by it); null: one device. Rollouts run on the mesh's first device, which holds a full copy of the weights."""
    fixed_shape: bool = False
    """Decode rollouts with the trainer's own log-prob program at one shape (prompts_per_step x group_size rows of the run's length, no KV cache): each reply token's log-prob is then bitwise the trainer's. Every token recomputes the whole sequence, so rollouts are slower; the held-out evaluation still uses the engine."""

    @model_validator(mode="after")
    def _check_source(self) -> RLConfig:
        if (self.task is None) == (self.prompts is None):
            raise ValueError(
                "task: give a built-in task or a prompts file (with reward), not both or neither"
            )
        if self.prompts is not None and self.reward is None:
            raise ValueError(
                "reward: a prompts file needs a reward function (module:function or file.py:function)"
            )
        return self

    @model_validator(mode="after")
    def _check_mesh(self) -> RLConfig:
        if self.mesh is None:
            return self
        other = [a for a in ("pipeline", "context", "tensor", "expert") if getattr(self.mesh, a) != 1]
        if other:
            raise ValueError(
                f"mesh: rl splits its trainer over data and fsdp only (got {', '.join(other)} > 1); set them to 1"
            )
        return self


def build_rl_config(overrides: list[str]) -> RLConfig:
    """An RLConfig from `key=value` overrides (values parsed as YAML); ConfigError in one line."""
    data = apply_overrides({}, overrides)
    try:
        return RLConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(
            format_validation_error(e, RLConfig).replace("invalid config", "invalid rl config")
        ) from e


def _schema_at(loc: tuple, root: type[BaseModel]) -> type[BaseModel] | None:
    """The schema class that owns location `loc` (for listing valid keys)."""
    schema: Any = root
    for part in loc:
        field = schema.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return None
        ann = field.annotation
        candidates = [ann, *getattr(ann, "__args__", ())]
        schema = next(
            (c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)),
            None,
        )
        if schema is None:
            return None
    return schema


def format_validation_error(err: ValidationError, root: type[BaseModel] | None = None) -> str:
    """One line naming each bad field, what was given and what is expected."""
    parts = []
    for e in err.errors():
        loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        name = ".".join(str(p) for p in loc) or "config"
        if e["type"] == "extra_forbidden":
            owner = _schema_at(loc[:-1], root or Config)
            valid = f" (valid keys: {', '.join(owner.model_fields)})" if owner else ""
            parts.append(f"{name}: unknown key{valid}")
            continue
        msg = e["msg"].removeprefix("Value error, ")
        # Cross-field validators start their message with the offending field.
        field = re.match(r"^([\w.]+): ", msg)
        if e["type"] == "value_error" and field:
            name = ".".join([*(str(p) for p in loc), field.group(1)])
            msg = msg[field.end() :]
        given = "" if e["type"] in ("missing", "value_error") else f" (got {e['input']!r})"
        parts.append(f"{name}: {msg}{given}")
    return "invalid config: " + "; ".join(parts)


def build_config(data: dict) -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e)) from e


def load_config(source: str, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Resolve a preset name or YAML path plus dotted overrides into a `Config`."""
    return build_config(apply_overrides(_load_source(source), list(overrides)))


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
