//! Command line and environment: clap [`Args`] (every flag has an `EXACTSCORE_*` variable),
//! validated into a [`Config`]. The only place that reads the environment.

use std::path::PathBuf;
use std::time::Duration;

use candle_core::DType;
use clap::{Parser, ValueEnum};

use crate::engine::fault::FaultInjection;
use crate::engine::BatchLimits;
use crate::model::AttentionKernel;
use crate::quant::fused_shards::FusedFp8Scales;
use crate::quant::{ActivationQuantMode, Fp8Matmul, KvCacheDtype, KvCacheOptions, KvCacheQuant};

/// The tiny bundled checkpoint, so that `cargo run -p exactscore-server` serves at once.
pub const DEFAULT_MODEL_DIR: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../tests/fixtures/llama-w4a16-g128"
);

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DtypeArg {
    F32,
    Bf16,
    F16,
}

impl From<DtypeArg> for DType {
    fn from(d: DtypeArg) -> Self {
        match d {
            DtypeArg::F32 => DType::F32,
            DtypeArg::Bf16 => DType::BF16,
            DtypeArg::F16 => DType::F16,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ActQuantArg {
    Emulate,
    Off,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Fp8MatmulArg {
    TensorCores,
    TensorCoresFastAccum,
    Emulated,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum FusedFp8ScalesArg {
    Served,
    PerLayer,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum KvCacheDtypeArg {
    Auto,
    #[value(name = "fp8_e4m3")]
    Fp8E4m3,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum AttentionArg {
    Auto,
    Materialized,
    Flash,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Clone, Parser)]
#[command(name = "exactscore-server", version, about)]
pub struct Args {
    /// Checkpoint directory (config.json, *.safetensors, tokenizer.json).
    #[arg(long, env = "EXACTSCORE_MODEL", default_value = DEFAULT_MODEL_DIR)]
    pub model: PathBuf,
    /// Name reported by the API (default: the directory name).
    #[arg(long, env = "EXACTSCORE_SERVED_MODEL_NAME")]
    pub served_model_name: Option<String>,
    #[arg(long, env = "EXACTSCORE_HOST", default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, env = "EXACTSCORE_PORT", default_value_t = 8000)]
    pub port: u16,
    /// Compute dtype.
    #[arg(long, env = "EXACTSCORE_DTYPE", value_enum, default_value = "f32")]
    pub dtype: DtypeArg,
    /// `cpu`, or CUDA devices such as `cuda:0` (needs a build with `--features cuda`). A list
    /// (`cuda:0,cuda:1`) splits the model into pipeline stages, one per device, each with its
    /// own thread and stream; a device may be listed more than once (`cpu,cpu`).
    #[arg(long, env = "EXACTSCORE_DEVICE", default_value = "cpu")]
    pub device: String,
    /// Copies of the model: the `--device` list is cut into this many equal groups of
    /// consecutive devices, one replica (a chain of pipeline stages) per group.
    #[arg(long, env = "EXACTSCORE_REPLICAS", default_value_t = 1)]
    pub replicas: usize,
    /// Decoder layers per pipeline stage, e.g. `30,50` (one number per device of a replica,
    /// summing to the model's layer count). Default: balance each device's weight bytes plus its
    /// expected activation peak at `--max-batch-tokens`.
    #[arg(long, env = "EXACTSCORE_LAYER_SPLIT", value_delimiter = ',')]
    pub layer_split: Option<Vec<usize>>,
    /// Sequences per pipeline micro-batch: a batch is cut into micro-batches of whole
    /// sequences so that stage k works on one while stage k+1 works on the one before. Default:
    /// a batch is cut into as many micro-batches as its replica has distinct GPUs (one on a
    /// single device, where cutting only costs GEMM efficiency).
    #[arg(long, env = "EXACTSCORE_MICRO_BATCH_SEQUENCES")]
    pub micro_batch_sequences: Option<usize>,
    /// Apply the activation quantization the checkpoint declares (`emulate`) or not (`off`).
    #[arg(
        long,
        env = "EXACTSCORE_ACTIVATION_QUANT",
        value_enum,
        default_value = "emulate"
    )]
    pub activation_quant: ActQuantArg,
    /// How a Linear with fp8 e4m3 weights (per channel or tensor) and fp8 activations (per
    /// token or static) multiplies in bf16/f16 on a GPU with fp8 tensor cores (compute
    /// capability 8.9+): the e4m3 codes on the tensor cores with f32 sums, as vLLM runs it
    /// (`tensor-cores`; block FP8 on Hopper too), summed in Hopper's fp8 accumulator as
    /// vLLM's per-channel CUTLASS kernels do (`tensor-cores-fast-accum`), or the QDQ'd
    /// activations times the dequantized weight in bf16 (`emulated`). f32 and the CPU always
    /// emulate.
    #[arg(
        long,
        env = "EXACTSCORE_FP8_MATMUL",
        value_enum,
        default_value = "tensor-cores"
    )]
    pub fp8_matmul: Fp8MatmulArg,
    /// Per-tensor fp8 layers that vLLM fuses (q/k/v, gate/up) with a scale each: as vLLM serves
    /// them (`served`: one weight scale per fused layer, the largest, each shard's codes
    /// requantized to it, and the largest static input scale; compressed-tensors W8A8 and
    /// ModelOpt FP8), or each layer's own scales as transformers reads them (`per-layer`).
    #[arg(
        long,
        env = "EXACTSCORE_FUSED_FP8_SCALES",
        value_enum,
        default_value = "served"
    )]
    pub fused_fp8_scales: FusedFp8ScalesArg,
    /// Apply the checkpoint's `kv_cache_scheme` (fp8 K/V, and q, after RoPE, as vLLM's
    /// FlashAttention 3 path does: docs/kv-cache.md) or not (`off`).
    #[arg(
        long,
        env = "EXACTSCORE_KV_CACHE_QUANT",
        value_enum,
        default_value = "emulate"
    )]
    pub kv_cache_quant: ActQuantArg,
    /// `fp8_e4m3`: simulate an fp8 KV cache on a checkpoint without a `kv_cache_scheme`, with
    /// dynamic per-head scales (absmax / 448 per sequence; not vLLM's default of 1.0).
    #[arg(
        long,
        env = "EXACTSCORE_KV_CACHE_DTYPE",
        value_enum,
        default_value = "auto"
    )]
    pub kv_cache_dtype: KvCacheDtypeArg,
    /// Attention kernel: `materialized` (f32 scores, every device and dtype), `flash` (fused,
    /// CUDA with bf16/f16 compute and head sizes 64, 128, 192 or 256, latent attention padded
    /// to one; see docs/performance.md), or `auto`: flash where it exists, materialized
    /// elsewhere.
    #[arg(long, env = "EXACTSCORE_ATTENTION", value_enum, default_value = "auto")]
    pub attention: AttentionArg,
    /// Require `Authorization: Bearer <key>` on every route but `/health/*`.
    #[arg(long, env = "EXACTSCORE_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Serve `/metrics` without the API key (for a Prometheus scraper without credentials);
    /// every other route still needs it.
    #[arg(long, env = "EXACTSCORE_METRICS_WITHOUT_AUTH")]
    pub metrics_without_auth: bool,
    /// On SIGTERM or ctrl-c the server turns not-ready, answers new scoring requests 503 and
    /// lets admitted ones finish for at most this long, then closes what is left and exits 0.
    #[arg(long, env = "EXACTSCORE_DRAIN_TIMEOUT_SECS", default_value_t = 30)]
    pub drain_timeout_secs: u64,
    /// Largest request body accepted (413 beyond).
    #[arg(long, env = "EXACTSCORE_MAX_BODY_BYTES", default_value_t = 8 * 1024 * 1024)]
    pub max_body_bytes: usize,
    /// Time limit of one request, queueing included (504 beyond).
    #[arg(long, env = "EXACTSCORE_REQUEST_TIMEOUT_SECS", default_value_t = 600)]
    pub request_timeout_secs: u64,
    /// A connection must send a whole request head within this long of being ready for one
    /// (accepted, or its previous response written), else it is closed: bounds half-sent
    /// heads and idle keep-alive connections.
    #[arg(
        long,
        env = "EXACTSCORE_HEADER_READ_TIMEOUT_SECS",
        default_value_t = 30
    )]
    pub header_read_timeout_secs: u64,
    /// A request body must arrive whole within this long of its head (408 beyond).
    #[arg(long, env = "EXACTSCORE_BODY_READ_TIMEOUT_SECS", default_value_t = 60)]
    pub body_read_timeout_secs: u64,
    /// Sum of sequence lengths computed in one batch. 16384 is the measured optimum on an H100
    /// (Llama-3-8B shape, W4A16, 2048-token windows: 48.2 ms/window at 8 windows per forward,
    /// 49.1 at 4, peak 6.9 vs 6.8 GiB; docs/performance.md).
    #[arg(long, env = "EXACTSCORE_MAX_BATCH_TOKENS", default_value_t = 16384)]
    pub max_batch_tokens: usize,
    /// Sequences computed in one batch.
    #[arg(long, env = "EXACTSCORE_MAX_BATCH_REQUESTS", default_value_t = 64)]
    pub max_batch_requests: usize,
    /// Longest sequence accepted (422 beyond), up to the model's context (131072 for Llama
    /// 3.1) with --max-batch-tokens at least as large. Default: the model's context length or
    /// --max-batch-tokens, whichever is smaller, lowered to what the memory plan admits.
    /// Start-up refuses a value whose expected peak does not fit (see --max-memory-gib),
    /// saying what would.
    #[arg(long, env = "EXACTSCORE_MAX_INPUT_TOKENS")]
    pub max_input_tokens: Option<usize>,
    /// Memory each device may hold for its models' weights and activations, in GiB (shared by
    /// the stages and models on it). Default: a GPU's total memory less 8 %, the host's
    /// available memory (`MemAvailable`) for the CPU.
    #[arg(long, env = "EXACTSCORE_MAX_MEMORY_GIB")]
    pub max_memory_gib: Option<f64>,
    /// Largest compute one request may ask for, in token-layers (one token through one decoder
    /// layer of one model; a final norm and lm_head count as one more; `/diff` attribution
    /// counts its extra runs of the reference); 422 before any work beyond. Default: 16 full
    /// batches, 16 × --max-batch-tokens × (the served model's layers + 1).
    #[arg(long, env = "EXACTSCORE_MAX_REQUEST_COST")]
    pub max_request_cost: Option<u64>,
    /// Largest answer admitted, by an upper estimate made before any work (422 beyond): a
    /// `/score` with `top_k` 20 and token strings answers ~300 times its body.
    #[arg(long, env = "EXACTSCORE_MAX_RESPONSE_BYTES", default_value_t = 128 << 20)]
    pub max_response_bytes: u64,
    /// HTTP requests admitted at once (queued or computing); 429 with Retry-After beyond.
    #[arg(long, env = "EXACTSCORE_MAX_QUEUED_REQUESTS", default_value_t = 256)]
    pub max_queued_requests: usize,
    #[arg(
        long,
        env = "EXACTSCORE_LOG_FORMAT",
        value_enum,
        default_value = "text"
    )]
    pub log_format: LogFormat,
    /// A second checkpoint, typically the unquantized original of `--model`, loaded beside it
    /// for `/kld` (KL-divergence of the served model from it). Its vocabulary must match.
    #[arg(long, env = "EXACTSCORE_REFERENCE_MODEL")]
    pub reference_model: Option<PathBuf>,
    /// Devices of the reference model, in `--device`'s syntax; cut into `--replicas` groups like
    /// `--device` (default: the first device of each served replica). A CPU model needs a CPU
    /// reference, a GPU model a GPU one.
    #[arg(long, env = "EXACTSCORE_REFERENCE_DEVICE")]
    pub reference_device: Option<String>,
    /// Compute dtype of the reference model (default: `--dtype`). The same checkpoint as
    /// `--model` in `f32` against a `bf16` served model measures what bf16 arithmetic alone
    /// costs: the noise floor of a KL-divergence.
    #[arg(long, env = "EXACTSCORE_REFERENCE_DTYPE", value_enum)]
    pub reference_dtype: Option<DtypeArg>,
    /// `--layer-split` of the reference model.
    #[arg(long, env = "EXACTSCORE_REFERENCE_LAYER_SPLIT", value_delimiter = ',')]
    pub reference_layer_split: Option<Vec<usize>>,
    /// Testing only: inject a fault into the engine (`device-lost-after:N` batches,
    /// `out-of-memory-above:N` tokens; `@R` appended: only in replica R) to drive the failure
    /// paths of the real binary.
    #[arg(long, env = "EXACTSCORE_INJECT_FAULT", hide = true)]
    pub inject_fault: Option<FaultInjection>,
    /// Print the OpenAPI document of the served router and exit (no model is loaded).
    #[arg(long)]
    pub print_openapi: bool,
    /// Ask the server at --host/--port for `/health/ready` and exit 0 if it answers 200, else 1
    /// (a container health check without curl; no model is loaded).
    #[arg(long, conflicts_with = "print_openapi")]
    pub healthcheck: bool,
}

/// One device of a `--device` list. Listing a device more than once (`cpu,cpu`,
/// `cuda:0,cuda:0`) makes that many pipeline stages on it, each with its own thread (and on a GPU
/// its own stream): the code path of several GPUs, testable on one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeviceName {
    Cpu,
    Cuda(usize),
}

impl std::fmt::Display for DeviceName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda(id) => write!(f, "cuda:{id}"),
        }
    }
}

/// Where a model runs: its replicas, each a list of devices (one pipeline stage per device).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceSpec {
    pub replicas: Vec<Vec<DeviceName>>,
}

/// As the flags take it: stages joined by `,`, replicas by ` | ` (`cuda:0,cuda:1 | cuda:2,cuda:3`).
impl std::fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let replicas: Vec<String> = self
            .replicas
            .iter()
            .map(|stages| {
                let names: Vec<String> = stages.iter().map(|d| d.to_string()).collect();
                names.join(",")
            })
            .collect();
        f.write_str(&replicas.join(" | "))
    }
}

impl DeviceSpec {
    /// One replica of one stage on the CPU.
    pub fn cpu() -> Self {
        Self {
            replicas: vec![vec![DeviceName::Cpu]],
        }
    }

    /// Every device, replica after replica, as `/info` reports them.
    pub fn names(&self) -> Vec<String> {
        self.replicas
            .iter()
            .flatten()
            .map(|d| d.to_string())
            .collect()
    }

    pub fn is_cpu(&self) -> bool {
        self.replicas
            .iter()
            .flatten()
            .all(|d| *d == DeviceName::Cpu)
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ConfigError {
    #[error("--{flag} {value}: {rule}")]
    Invalid {
        flag: &'static str,
        value: String,
        rule: String,
    },
}

/// The flags that place or shape the reference model, given without one: named, with what
/// they need.
fn check_no_reference_flags(args: &Args) -> Result<(), ConfigError> {
    let needs = "needs --reference-model (the reference checkpoint it applies to)";
    if let Some(device) = &args.reference_device {
        return Err(invalid("reference-device", device, needs));
    }
    if let Some(dtype) = args.reference_dtype {
        return Err(invalid(
            "reference-dtype",
            DType::from(dtype).as_str(),
            needs,
        ));
    }
    if let Some(split) = &args.reference_layer_split {
        let split: Vec<String> = split.iter().map(|n| n.to_string()).collect();
        return Err(invalid("reference-layer-split", split.join(","), needs));
    }
    Ok(())
}

fn invalid(flag: &'static str, value: impl ToString, rule: impl ToString) -> ConfigError {
    ConfigError::Invalid {
        flag,
        value: value.to_string(),
        rule: rule.to_string(),
    }
}

/// Validated settings. `max_input_tokens` is resolved against the model's context at load.
#[derive(Debug, Clone)]
pub struct Config {
    pub model_dir: PathBuf,
    pub served_model_name: String,
    pub host: String,
    pub port: u16,
    pub dtype: DType,
    pub device: DeviceSpec,
    /// `--layer-split`: decoder layers per stage, or `None` to balance them.
    pub layer_split: Option<Vec<usize>>,
    /// `--micro-batch-sequences`, or `None` for the default.
    pub micro_batch_sequences: Option<usize>,
    pub activation_quant: ActivationQuantMode,
    pub fp8_matmul: Fp8Matmul,
    pub fused_fp8_scales: FusedFp8Scales,
    pub kv_cache: KvCacheOptions,
    pub attention: AttentionKernel,
    pub http: HttpConfig,
    pub batch: BatchLimits,
    pub max_input_tokens: Option<usize>,
    /// `--max-memory-gib` in bytes, or `None` for what each device has.
    pub max_memory: Option<u64>,
    /// `--max-request-cost`, or `None` for the default (resolved against the model at load).
    pub max_request_cost: Option<u64>,
    pub max_response_bytes: u64,
    pub max_queued_requests: usize,
    pub log_format: LogFormat,
    /// The model `/kld` compares against.
    pub reference: Option<ReferenceConfig>,
    /// `--inject-fault` (testing only).
    pub inject_fault: Option<FaultInjection>,
}

/// `--reference-model` and where it runs: as many replicas as the served model, replica `i`
/// paired with the served model's replica `i`.
#[derive(Debug, Clone)]
pub struct ReferenceConfig {
    pub model_dir: PathBuf,
    pub name: String,
    pub device: DeviceSpec,
    pub layer_split: Option<Vec<usize>>,
    /// Compute dtype (`--reference-dtype`, else the served model's).
    pub dtype: DType,
}

/// What the HTTP layer needs beyond the model. Its `Debug` never shows the key.
#[derive(Clone)]
pub struct HttpConfig {
    pub api_key: Option<String>,
    /// `/metrics` is open like `/health/*`.
    pub metrics_without_auth: bool,
    pub max_body_bytes: usize,
    pub request_timeout: Duration,
    /// How long admitted requests may take to finish after a shutdown signal.
    pub drain_timeout: Duration,
    /// See `--header-read-timeout-secs` and `--body-read-timeout-secs`.
    pub header_read_timeout: Duration,
    pub body_read_timeout: Duration,
}

impl std::fmt::Debug for HttpConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpConfig")
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("metrics_without_auth", &self.metrics_without_auth)
            .field("max_body_bytes", &self.max_body_bytes)
            .field("request_timeout", &self.request_timeout)
            .field("drain_timeout", &self.drain_timeout)
            .field("header_read_timeout", &self.header_read_timeout)
            .field("body_read_timeout", &self.body_read_timeout)
            .finish()
    }
}

impl Config {
    pub fn from_args(args: Args) -> Result<Self, ConfigError> {
        let positive = |flag, v: usize| {
            if v == 0 {
                Err(invalid(flag, v, "must be at least 1"))
            } else {
                Ok(v)
            }
        };
        positive("replicas", args.replicas)?;
        let dtype = args.dtype.into();
        let device = device_spec("device", &args.device, args.replicas)?;
        if let Some(split) = &args.layer_split {
            check_layer_split("layer-split", split, &device)?;
        }
        if let Some(n) = args.micro_batch_sequences {
            positive("micro-batch-sequences", n)?;
        }
        positive("max-batch-tokens", args.max_batch_tokens)?;
        positive("max-batch-requests", args.max_batch_requests)?;
        positive("max-queued-requests", args.max_queued_requests)?;
        positive("max-body-bytes", args.max_body_bytes)?;
        if args.max_request_cost == Some(0) {
            return Err(invalid("max-request-cost", 0, "must be at least 1"));
        }
        if args.max_response_bytes == 0 {
            return Err(invalid("max-response-bytes", 0, "must be at least 1"));
        }
        if args.request_timeout_secs == 0 {
            return Err(invalid("request-timeout-secs", 0, "must be at least 1"));
        }
        if args.drain_timeout_secs == 0 {
            return Err(invalid("drain-timeout-secs", 0, "must be at least 1"));
        }
        for (flag, secs) in [
            ("header-read-timeout-secs", args.header_read_timeout_secs),
            ("body-read-timeout-secs", args.body_read_timeout_secs),
        ] {
            if secs == 0 {
                return Err(invalid(flag, 0, "must be at least 1"));
            }
        }
        if let Some(max) = args.max_input_tokens {
            positive("max-input-tokens", max)?;
            // Otherwise a maximal sequence could never be batched (the queue would still run
            // it alone, but the budget would silently not mean what it says).
            if max > args.max_batch_tokens {
                return Err(invalid(
                    "max-input-tokens",
                    max,
                    format!(
                        "must not exceed --max-batch-tokens ({})",
                        args.max_batch_tokens
                    ),
                ));
            }
        }
        if let Some(gib) = args.max_memory_gib {
            if !(gib.is_finite() && gib > 0.0) {
                return Err(invalid("max-memory-gib", gib, "must be a positive number"));
            }
        }
        if let Some(key) = &args.api_key {
            check_api_key(key)?;
        }
        if args.reference_model.is_none() {
            check_no_reference_flags(&args)?;
        }
        let reference = args
            .reference_model
            .map(|dir| {
                reference_config(
                    dir,
                    args.reference_device.as_deref(),
                    args.reference_layer_split,
                    args.reference_dtype.map_or(dtype, DType::from),
                    &device,
                )
            })
            .transpose()?;
        let served_model_name = match args.served_model_name {
            Some(name) if !name.trim().is_empty() => name,
            Some(name) => return Err(invalid("served-model-name", name, "must not be blank")),
            None => args
                .model
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| "model".into()),
        };
        let kv_cache = KvCacheOptions {
            quant: match args.kv_cache_quant {
                ActQuantArg::Emulate => KvCacheQuant::Emulate,
                ActQuantArg::Off => KvCacheQuant::Off,
            },
            dtype: match args.kv_cache_dtype {
                KvCacheDtypeArg::Auto => KvCacheDtype::Auto,
                KvCacheDtypeArg::Fp8E4m3 => KvCacheDtype::Fp8E4m3,
            },
        };
        if kv_cache.quant == KvCacheQuant::Off && kv_cache.dtype == KvCacheDtype::Fp8E4m3 {
            return Err(invalid(
                "--kv-cache-dtype",
                "fp8_e4m3",
                "simulates a quantized KV cache; it contradicts --kv-cache-quant off",
            ));
        }
        Ok(Self {
            model_dir: args.model,
            served_model_name,
            host: args.host,
            port: args.port,
            dtype,
            device,
            layer_split: args.layer_split,
            micro_batch_sequences: args.micro_batch_sequences,
            activation_quant: match args.activation_quant {
                ActQuantArg::Emulate => ActivationQuantMode::Emulate,
                ActQuantArg::Off => ActivationQuantMode::Off,
            },
            fp8_matmul: match args.fp8_matmul {
                Fp8MatmulArg::TensorCores => Fp8Matmul::TensorCores,
                Fp8MatmulArg::TensorCoresFastAccum => Fp8Matmul::TensorCoresFastAccum,
                Fp8MatmulArg::Emulated => Fp8Matmul::Emulated,
            },
            fused_fp8_scales: match args.fused_fp8_scales {
                FusedFp8ScalesArg::Served => FusedFp8Scales::Served,
                FusedFp8ScalesArg::PerLayer => FusedFp8Scales::PerLayer,
            },
            kv_cache,
            attention: match args.attention {
                AttentionArg::Auto => AttentionKernel::Auto,
                AttentionArg::Materialized => AttentionKernel::Materialized,
                AttentionArg::Flash => AttentionKernel::Flash,
            },
            http: HttpConfig {
                api_key: args.api_key,
                metrics_without_auth: args.metrics_without_auth,
                max_body_bytes: args.max_body_bytes,
                request_timeout: Duration::from_secs(args.request_timeout_secs),
                drain_timeout: Duration::from_secs(args.drain_timeout_secs),
                header_read_timeout: Duration::from_secs(args.header_read_timeout_secs),
                body_read_timeout: Duration::from_secs(args.body_read_timeout_secs),
            },
            batch: BatchLimits {
                max_batch_tokens: args.max_batch_tokens,
                max_batch_requests: args.max_batch_requests,
            },
            max_input_tokens: args.max_input_tokens,
            max_memory: args
                .max_memory_gib
                .map(|gib| (gib * (1u64 << 30) as f64) as u64),
            max_request_cost: args.max_request_cost,
            max_response_bytes: args.max_response_bytes,
            max_queued_requests: args.max_queued_requests,
            log_format: args.log_format,
            reference,
            inject_fault: args.inject_fault,
        })
    }

    /// `--max-input-tokens`, or the model context capped by the batch budget (which the
    /// memory plan may lower at load).
    pub fn resolve_max_input_tokens(&self, model_context: usize) -> usize {
        self.max_input_tokens
            .unwrap_or_else(|| model_context.min(self.batch.max_batch_tokens).max(1))
    }
}

/// A key that a client can send in `Authorization: Bearer KEY`: visible ASCII only (RFC 6750's
/// token68 has no spaces). Anything else starts a server that answers 401 to everyone: a
/// secret file's trailing newline, a pasted space, a non-ASCII character. The key itself is
/// never echoed.
fn check_api_key(key: &str) -> Result<(), ConfigError> {
    let shown = format!("<{} characters>", key.chars().count());
    let rule = if key.is_empty() {
        "must not be empty".to_string()
    } else if key.trim() != key {
        "has leading or trailing whitespace (a trailing newline of a secret file?); remove it"
            .to_string()
    } else if let Some(at) = key.chars().position(|c| !c.is_ascii_graphic()) {
        format!(
            "character {at} is a space, a control character or not ASCII, which an \
             Authorization header cannot carry; use visible ASCII only"
        )
    } else {
        return Ok(());
    };
    Err(invalid("api-key", shown, rule))
}

fn reference_config(
    model_dir: PathBuf,
    device: Option<&str>,
    layer_split: Option<Vec<usize>>,
    dtype: DType,
    model_device: &DeviceSpec,
) -> Result<ReferenceConfig, ConfigError> {
    let replicas = model_device.replicas.len();
    let device = match device {
        None => DeviceSpec {
            replicas: model_device
                .replicas
                .iter()
                .map(|r| r[..1].to_vec())
                .collect(),
        },
        Some(s) => {
            let parsed = device_spec("reference-device", s, replicas)?;
            // The divergence is computed where the served model's logits are; a CPU/GPU mix
            // would move whole vocabulary rows between host and device.
            if parsed.is_cpu() != model_device.is_cpu() {
                return Err(invalid(
                    "reference-device",
                    s,
                    format!(
                        "must be a CPU with a CPU model and a GPU with a GPU model (--device is {})",
                        model_device.names().join(",")
                    ),
                ));
            }
            parsed
        }
    };
    if let Some(split) = &layer_split {
        check_layer_split("reference-layer-split", split, &device)?;
    }
    let name = model_dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "reference".into());
    Ok(ReferenceConfig {
        model_dir,
        name,
        device,
        layer_split,
        dtype,
    })
}

/// `--device` (or `--reference-device`, named by `flag`) cut into `replicas` groups.
fn device_spec(flag: &'static str, s: &str, replicas: usize) -> Result<DeviceSpec, ConfigError> {
    let devices = parse_devices(flag, s)?;
    if !devices.len().is_multiple_of(replicas) {
        return Err(invalid(
            flag,
            s,
            format!(
                "{} devices cannot be cut into --replicas {replicas} equal groups",
                devices.len()
            ),
        ));
    }
    let per_replica = devices.len() / replicas;
    Ok(DeviceSpec {
        replicas: devices.chunks(per_replica).map(<[_]>::to_vec).collect(),
    })
}

/// A layer split names one count per device of a replica, each at least 1 (the sum is checked
/// against the model's layer count at load).
fn check_layer_split(
    flag: &'static str,
    split: &[usize],
    device: &DeviceSpec,
) -> Result<(), ConfigError> {
    let value = || {
        split
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(",")
    };
    let stages = device.replicas[0].len();
    if split.len() != stages {
        return Err(invalid(
            flag,
            value(),
            format!("needs one layer count per device of a replica ({stages})"),
        ));
    }
    if split.contains(&0) {
        return Err(invalid(
            flag,
            value(),
            "every stage needs at least one layer",
        ));
    }
    Ok(())
}

/// `cpu`, `cuda`, `cuda:0`, `cuda:0,1`, `cuda:0,cuda:1`, `cpu,cpu`, ...
fn parse_devices(flag: &'static str, s: &str) -> Result<Vec<DeviceName>, ConfigError> {
    const EXPECTED: &str = "expected `cpu` or `cuda:N`, or a comma-separated list of them";
    let mut devices = Vec::new();
    for part in s.split(',') {
        let part = part.trim();
        let device = match part {
            "cpu" => DeviceName::Cpu,
            "cuda" => DeviceName::Cuda(0),
            _ => {
                // A bare number continues a CUDA list (`cuda:0,1`).
                let id = match part.strip_prefix("cuda:") {
                    Some(id) => id,
                    None if matches!(devices.last(), Some(DeviceName::Cuda(_))) => part,
                    None => return Err(invalid(flag, s, EXPECTED)),
                };
                DeviceName::Cuda(id.parse().map_err(|_| invalid(flag, s, EXPECTED))?)
            }
        };
        devices.push(device);
    }
    let cpu = devices.iter().filter(|d| **d == DeviceName::Cpu).count();
    if cpu > 0 && cpu < devices.len() {
        return Err(invalid(
            flag,
            s,
            "a model runs on the CPU or on GPUs, not on both",
        ));
    }
    if cpu == 0 && !cfg!(feature = "cuda") {
        return Err(invalid(
            flag,
            s,
            "this binary was built without CUDA support; rebuild with \
             `cargo build --release -p exactscore-server --features cuda` or use `--device cpu`",
        ));
    }
    Ok(devices)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(extra: &[&str]) -> Result<Config, ConfigError> {
        let mut argv = vec!["exactscore-server"];
        argv.extend_from_slice(extra);
        Config::from_args(Args::try_parse_from(argv).expect("clap"))
    }

    #[test]
    fn defaults_serve_the_bundled_fixture_on_cpu() {
        let c = parse(&[]).unwrap();
        assert!(c.model_dir.join("config.json").is_file());
        assert_eq!(c.served_model_name, "llama-w4a16-g128");
        assert_eq!(c.device, DeviceSpec::cpu());
        assert_eq!(c.dtype, DType::F32);
        assert_eq!((c.host.as_str(), c.port), ("127.0.0.1", 8000));
        assert_eq!(c.resolve_max_input_tokens(131072), 16384);
        assert_eq!(c.resolve_max_input_tokens(512), 512);
    }

    #[test]
    fn kv_cache_flags_map_and_their_contradiction_is_refused() {
        let c = parse(&["--kv-cache-dtype", "fp8_e4m3"]).unwrap();
        assert_eq!(
            c.kv_cache,
            KvCacheOptions {
                quant: KvCacheQuant::Emulate,
                dtype: KvCacheDtype::Fp8E4m3
            }
        );
        assert_eq!(parse(&[]).unwrap().kv_cache, KvCacheOptions::default());
        let off = parse(&["--kv-cache-quant", "off"]).unwrap();
        assert_eq!(off.kv_cache.quant, KvCacheQuant::Off);
        let msg = parse(&["--kv-cache-quant", "off", "--kv-cache-dtype", "fp8_e4m3"])
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("--kv-cache-dtype") && msg.contains("--kv-cache-quant off"),
            "{msg}"
        );
    }

    #[test]
    fn cuda_needs_the_feature() {
        let err = parse(&["--device", "cuda:0"]);
        if cfg!(feature = "cuda") {
            assert!(err.is_ok());
        } else {
            let msg = err.unwrap_err().to_string();
            assert!(msg.contains("without CUDA support"), "{msg}");
        }
    }

    #[test]
    fn bad_values_are_refused_with_the_flag() {
        for (argv, flag) in [
            (&["--device", "tpu"][..], "--device"),
            (&["--max-batch-tokens", "0"][..], "--max-batch-tokens"),
            (
                &["--max-input-tokens", "9000", "--max-batch-tokens", "4096"][..],
                "--max-input-tokens",
            ),
            (&["--api-key", ""][..], "--api-key"),
            (&["--max-memory-gib", "0"][..], "--max-memory-gib"),
            (&["--max-memory-gib", "NaN"][..], "--max-memory-gib"),
            (
                &["--reference-model", "x", "--reference-device", "gpu"][..],
                "--reference-device",
            ),
            (&["--device", "cpu,cuda:0"][..], "--device"),
            (&["--device", "7"][..], "--device"),
            (
                &["--device", "cpu,cpu,cpu", "--replicas", "2"][..],
                "--device",
            ),
            (&["--replicas", "0"][..], "--replicas"),
            (
                &["--device", "cpu,cpu", "--layer-split", "1"][..],
                "--layer-split",
            ),
            (
                &["--device", "cpu,cpu", "--layer-split", "2,0"][..],
                "--layer-split",
            ),
            (
                &["--micro-batch-sequences", "0"][..],
                "--micro-batch-sequences",
            ),
            (
                &[
                    "--device",
                    "cpu,cpu",
                    "--replicas",
                    "2",
                    "--reference-model",
                    "x",
                    "--reference-device",
                    "cpu,cpu,cpu",
                ][..],
                "--reference-device",
            ),
        ] {
            let msg = parse(argv).unwrap_err().to_string();
            assert!(msg.starts_with(flag), "{argv:?}: {msg}");
        }
    }

    /// Each of these started a server that answered 401 to every request.
    #[test]
    fn api_keys_that_cannot_be_sent_are_refused_without_echoing_them() {
        for (key, why) in [
            ("k-xyzzy1\n", "trailing whitespace"),
            ("k-xyzzy1\r\n", "trailing whitespace"),
            (" k-xyzzy1", "leading or trailing"),
            ("k-xyzzy1 ", "leading or trailing"),
            ("k-xy zzy", "character 4"),
            ("k-xézzy", "character 3"),
            ("k-xyzzy1\u{7f}", "character 8"),
            ("k-\txyzzy", "character 2"),
        ] {
            let msg = parse(&["--api-key", key]).unwrap_err().to_string();
            assert!(msg.starts_with("--api-key <"), "{key:?}: {msg}");
            assert!(msg.contains(why), "{key:?}: {msg}");
            assert!(!msg.contains("xyzzy") && !msg.contains("zzy"), "{msg}");
        }
        for key in ["k-xyzzy1", "Zm9v+YmFy/YmF6==", "a~b!c"] {
            assert_eq!(
                parse(&["--api-key", key]).unwrap().http.api_key.unwrap(),
                key
            );
        }
    }

    #[test]
    fn the_reference_defaults_to_the_model_device_and_needs_a_model() {
        let c = parse(&["--reference-model", "/models/bf16"]).unwrap();
        let r = c.reference.unwrap();
        assert_eq!((r.name.as_str(), &r.device), ("bf16", &DeviceSpec::cpu()));
        assert!(parse(&[]).unwrap().reference.is_none());
        assert!(parse(&["--reference-device", "cpu"]).is_err());
    }

    #[test]
    fn the_reference_dtype_defaults_to_the_model_dtype() {
        let c = parse(&["--dtype", "bf16", "--reference-model", "/r"]).unwrap();
        assert_eq!(c.reference.unwrap().dtype, DType::BF16);
        let both = [
            "--dtype",
            "bf16",
            "--reference-model",
            "/r",
            "--reference-dtype",
            "f32",
        ];
        let c = parse(&both).unwrap();
        assert_eq!(
            (c.dtype, c.reference.unwrap().dtype),
            (DType::BF16, DType::F32)
        );
    }

    /// A reference flag without a reference model is refused naming the flag and what it needs
    /// (clap's `requires` said only "the following required arguments were not provided").
    #[test]
    fn reference_flags_without_a_reference_model_name_themselves() {
        for (args, flag) in [
            (&["--reference-device", "cpu"][..], "--reference-device cpu"),
            (&["--reference-dtype", "f32"][..], "--reference-dtype f32"),
            (
                &["--reference-layer-split", "1,1"][..],
                "--reference-layer-split 1,1",
            ),
        ] {
            let err = parse(args).unwrap_err().to_string();
            assert!(
                err.starts_with(flag) && err.contains("needs --reference-model"),
                "{err}"
            );
        }
    }

    #[test]
    fn device_lists_make_stages_and_replicas() {
        use DeviceName::Cpu;
        let c = parse(&["--device", "cpu,cpu,cpu,cpu", "--replicas", "2"]).unwrap();
        assert_eq!(c.device.replicas, vec![vec![Cpu, Cpu], vec![Cpu, Cpu]]);
        assert_eq!(c.device.names(), ["cpu"; 4]);
        // The reference defaults to the first device of each replica.
        let c = parse(&[
            "--device",
            "cpu,cpu,cpu,cpu",
            "--replicas",
            "2",
            "--reference-model",
            "/r",
        ])
        .unwrap();
        assert_eq!(
            c.reference.unwrap().device.replicas,
            vec![vec![Cpu], vec![Cpu]]
        );
        let c = parse(&["--device", "cpu,cpu,cpu", "--layer-split", "1,3,2"]).unwrap();
        assert_eq!(c.layer_split, Some(vec![1, 3, 2]));
        if cfg!(feature = "cuda") {
            let c = parse(&["--device", "cuda:0,1,cuda:0"]).unwrap();
            use DeviceName::Cuda;
            assert_eq!(c.device.replicas, vec![vec![Cuda(0), Cuda(1), Cuda(0)]]);
        }
    }

    #[test]
    fn every_flag_has_an_env_var() {
        use clap::CommandFactory;
        for arg in Args::command().get_arguments() {
            let id = arg.get_id().as_str();
            if ["help", "version", "print_openapi", "healthcheck"].contains(&id) {
                continue;
            }
            let env = arg.get_env().map(|e| e.to_string_lossy().into_owned());
            let expected = format!("EXACTSCORE_{}", id.to_uppercase());
            assert_eq!(env.as_deref(), Some(expected.as_str()), "{id}");
        }
    }
}
