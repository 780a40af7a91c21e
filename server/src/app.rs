//! Assembly: models + tokenizer + engine + HTTP state from a [`Config`], warm-up, and serving
//! with graceful shutdown. Shared by `main` and the end-to-end tests.

use std::collections::BTreeMap;
use std::future::Future;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use candle_core::{DType, Device};
use exactscore_api::{Limits, ModelInfo, ReferenceInfo, ReplicaPlacement, StagePlacement};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use crate::checkpoint::{check_model_dir, Checkpoint, LoadError};
use crate::config::{Config, DeviceName, HttpConfig};
use crate::engine::batcher::EngineThread;
use crate::engine::fault::FaultInjecting;
use crate::engine::{
    BatchLimits, Cancel, Engine, EngineError, MicroBatching, ModelEngine, Scheduler,
};
use crate::http::budget::{max_token_json, Budget};
use crate::http::validate::MAX_TOP_K;
use crate::http::{self, AppState, Readiness, SharedState};
use crate::model::placement::{self, PlacementInputs, StagePlan};
use crate::model::{AttentionKernel, Model, ModelConfig, ModelOptions, ScoreInput};
use crate::quant::{KvCacheQdq, LinearOptions, QuantizationConfig};
use crate::tokenizer::{TextTokenizer, TokenizerError};

#[derive(Debug, thiserror::Error)]
pub enum AppError {
    #[error("loading the model: {0}")]
    Load(#[from] LoadError),
    #[error("loading the tokenizer: {0}")]
    Tokenizer(#[from] TokenizerError),
    #[error("device {device}: {message}")]
    Device { device: String, message: String },
    #[error("reference model {dir}: {message}")]
    Reference { dir: String, message: String },
    #[error("loading the reference model: {0}")]
    ReferenceLoad(LoadError),
    #[error("placing the layers of {model} on {devices}: {message}")]
    Placement {
        model: String,
        devices: String,
        message: String,
    },
    /// The memory plan: what the configuration is expected to need does not fit.
    #[error("{model} does not fit: {message}")]
    Memory { model: String, message: String },
    #[error("warm-up batch failed: {0}")]
    WarmUp(#[from] EngineError),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// A running engine with its HTTP state.
pub struct Server {
    pub state: SharedState,
    engine: EngineThread,
}

/// What the HTTP state is made of, besides the engine.
pub struct StateParts {
    pub info: ModelInfo,
    pub tokenizer: Arc<TextTokenizer>,
    pub http: HttpConfig,
    pub batch: BatchLimits,
}

/// How serving ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Shutdown {
    /// A signal, then the drain (admitted requests finished, or abandoned at the timeout).
    Drained,
    /// A sticky device error: the process must exit non-zero for its orchestrator to restart
    /// it. The message is the device's error.
    DeviceLost(String),
}

impl Server {
    /// Starts the engine of one replica and the batcher over any [`Engine`] (the fake one in
    /// HTTP tests). Not ready until [`Server::warm_up`].
    pub fn start(engine: Box<dyn Engine>, parts: StateParts) -> std::io::Result<Self> {
        Self::start_replicas(vec![Arc::from(engine)], parts)
    }

    /// Starts the workers of every replica and the batcher. Not ready until
    /// [`Server::warm_up`].
    pub fn start_replicas(
        engines: Vec<Arc<dyn Engine>>,
        parts: StateParts,
    ) -> std::io::Result<Self> {
        let (scheduler, engine) = Scheduler::start(engines, parts.batch)?;
        let info = &parts.info;
        let tokenizer = &parts.tokenizer;
        let budget = Budget {
            served_layers: info.num_layers,
            reference_layers: info.reference.as_ref().map(|r| r.num_layers),
            max_request_cost: info.limits.max_request_cost,
            max_response_bytes: info.limits.max_response_bytes,
            // Once per start: every token decoded as answers show it.
            max_token_json: max_token_json(info.vocab_size, |id| {
                let decoded = tokenizer.decode(&[id]).unwrap_or_default();
                let raw = tokenizer.token_string(id);
                Some(if decoded.len() > raw.len() {
                    decoded
                } else {
                    raw
                })
            }),
            id_digits: info.vocab_size.saturating_sub(1).max(1).to_string().len(),
        };
        let state = Arc::new(AppState {
            budget,
            scheduler,
            admission: Arc::new(Semaphore::new(parts.info.limits.max_queued_requests)),
            info: parts.info,
            tokenizer: parts.tokenizer,
            readiness: Arc::new(Readiness::default()),
            metrics: Some(http::metrics::recorder()),
            http: parts.http,
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        });
        Ok(Self { state, engine })
    }

    /// Loads the model named by `config` (and its reference model, if any), once per replica,
    /// and starts them (blocking work runs off the runtime).
    pub async fn load(config: &Config) -> Result<Self, AppError> {
        let cfg = config.clone();
        let loaded = tokio::task::spawn_blocking(move || load_models(&cfg))
            .await
            .map_err(|e| AppError::Io(std::io::Error::other(e)))??;
        let layers = loaded
            .replicas
            .first()
            .map_or(0, |r| r.model.model.config().num_layers);
        let limits = Limits {
            max_input_tokens: loaded.max_input_tokens,
            max_batch_tokens: config.batch.max_batch_tokens,
            max_batch_requests: config.batch.max_batch_requests,
            max_queued_requests: config.max_queued_requests,
            max_top_k: MAX_TOP_K,
            max_request_cost: config
                .max_request_cost
                .unwrap_or_else(|| Budget::default_cost(layers, config.batch.max_batch_tokens)),
            max_response_bytes: config.max_response_bytes,
        };
        let info = model_info(&loaded, config, limits);
        let parts = StateParts {
            info,
            tokenizer: Arc::new(loaded.tokenizer),
            http: config.http.clone(),
            batch: config.batch,
        };
        let micro_batching = match config.micro_batch_sequences {
            Some(n) => MicroBatching::Sequences(n),
            None => MicroBatching::PerDevice,
        };
        let mut engines: Vec<Arc<dyn Engine>> = Vec::new();
        for (index, replica) in loaded.replicas.into_iter().enumerate() {
            let engine: Arc<dyn Engine> = Arc::new(ModelEngine::new(
                replica.model.model,
                replica.reference.map(|r| r.model),
                micro_batching,
            )?);
            engines.push(match config.inject_fault {
                Some(f) if f.applies_to(index) => Arc::new(FaultInjecting::new(engine, f.fault)),
                _ => engine,
            });
        }
        Ok(Self::start_replicas(engines, parts)?)
    }

    /// Runs one small batch through every replica's engine (all stages, the reference too),
    /// the replicas side by side, then reports ready.
    pub async fn warm_up(&self) -> Result<(), AppError> {
        let bos = self.state.tokenizer.info().bos_token_id.unwrap_or(0);
        let token = bos.min(self.state.info.vocab_size.saturating_sub(1) as u32);
        let with_reference = self.state.info.reference.is_some();
        let runs: Vec<_> = self
            .state
            .scheduler
            .engines()
            .into_iter()
            .map(|engine| {
                tokio::task::spawn_blocking(move || -> Result<(), EngineError> {
                    let tokens = [token; 2];
                    // Also the first check of the whole path's numerics: NaN or infinite
                    // logits (a weight that overflows the compute dtype) fail the start.
                    let scores = engine.score(
                        &[ScoreInput {
                            stored: crate::model::StoredRequest::NONE,
                            tokens: &tokens,
                            top_k: 1,
                        }],
                        &Cancel::never(),
                    )?;
                    check_finite(&scores)?;
                    if with_reference {
                        check_finite(&engine.kld(&[&tokens], &Cancel::never())?)?;
                    }
                    Ok(())
                })
            })
            .collect();
        for run in runs {
            run.await
                .map_err(|e| AppError::Io(std::io::Error::other(e)))??;
        }
        self.state.readiness.set_warm();
        Ok(())
    }

    /// Serves until `shutdown` resolves or a device is lost, then drains: readiness turns 503
    /// at once and new scoring requests are answered 503 while the listener stays open (so a
    /// load balancer sees the probe fail instead of a refused connection). Once every admitted
    /// request has been answered the listener closes. If `--drain-timeout-secs` passes first,
    /// the requests still waiting are answered 503 `shutting_down` and compute stops at the
    /// next batch boundary; a worker still in the middle of a batch is left behind (the
    /// process exits). Returns how serving ended.
    pub async fn serve(
        self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<Shutdown> {
        let readiness = self.state.readiness.clone();
        let scheduler = self.state.scheduler.clone();
        let admission = self.state.admission.clone();
        let all_permits = self.state.limits().max_queued_requests as u32;
        let drain_timeout = self.state.http.drain_timeout;
        let header_read_timeout = self.state.http.header_read_timeout;
        let (signalled_tx, signalled_rx) = tokio::sync::oneshot::channel::<Instant>();
        let app = http::router(self.state);
        let lost = scheduler.device_lost();
        let drain_scheduler = scheduler.clone();
        let serve = http::serve::serve(listener, app, header_read_timeout);
        let serve = serve.with_graceful_shutdown(async move {
            tokio::select! {
                () = shutdown => {}
                message = lost => {
                    readiness.set_device_lost();
                    tracing::error!(%message, "device lost: not ready; draining, then exiting non-zero");
                }
            }
            let start = Instant::now();
            readiness.start_draining();
            let _ = signalled_tx.send(start);
            tracing::info!("shutting down: draining admitted requests");
            // Every admission permit back = no request queued or computing.
            let drained =
                tokio::time::timeout(drain_timeout, admission.acquire_many(all_permits)).await;
            match drained {
                Ok(_) => tracing::info!(
                    seconds = start.elapsed().as_secs_f64(),
                    "drained; closing the listener"
                ),
                Err(_) => {
                    tracing::warn!(
                        ?drain_timeout,
                        "drain timeout passed; answering what is left 503 and closing"
                    );
                    drain_scheduler.abandon();
                }
            }
        });
        // Connections that stay open after the drain (a slow reader) get one more second.
        let deadline = async move {
            match signalled_rx.await {
                Ok(start) => {
                    tokio::time::sleep_until(
                        (start + drain_timeout + Duration::from_secs(1)).into(),
                    )
                    .await
                }
                Err(_) => std::future::pending().await,
            }
        };
        tokio::select! {
            served = serve => served?,
            () = deadline => tracing::warn!("connections still open after the drain timeout; closing them"),
        }
        scheduler.shutdown();
        // A worker in the middle of a long batch after an abandoned drain, or one stuck on a
        // lost device, is not waited for.
        if self.engine.join_within(Duration::from_millis(500)).await {
            tracing::info!("engine stopped");
        } else {
            tracing::warn!("engine still computing; exiting without it");
        }
        Ok(match scheduler.lost_device() {
            Some(message) => {
                // Tearing down a context after a sticky error can block forever: the models
                // are left to the process exit.
                std::mem::forget(scheduler);
                Shutdown::DeviceLost(message)
            }
            None => Shutdown::Drained,
        })
    }
}

/// [`EngineError::NonFinite`] at the first output that is not finite.
fn check_finite<T: crate::engine::Finite>(outputs: &[Option<T>]) -> Result<(), EngineError> {
    match outputs.iter().flatten().find_map(|o| o.first_non_finite()) {
        Some(position) => Err(EngineError::NonFinite { position }),
        None => Ok(()),
    }
}

/// One replica's model (or reference model) and where its stages are.
pub struct Placed {
    pub model: Model,
    pub stages: Vec<(DeviceName, StagePlan)>,
}

/// One replica: the served model and, for `/kld`, the reference.
pub struct LoadedReplica {
    pub model: Placed,
    pub reference: Option<Placed>,
}

/// What start-up loads from disk.
pub struct Loaded {
    pub replicas: Vec<LoadedReplica>,
    pub tokenizer: TextTokenizer,
    pub max_input_tokens: usize,
    /// [`crate::checkpoint::fingerprint`] of the served checkpoint and of the reference's.
    pub checkpoint_sha256: String,
    pub reference_checkpoint_sha256: Option<String>,
}

fn load_models(config: &Config) -> Result<Loaded, AppError> {
    let dir = &config.model_dir;
    check_model_dir(dir)?;
    let model_config = ModelConfig::from_dir(dir)?;
    let max_input_tokens = config.resolve_max_input_tokens(model_config.max_position_embeddings);
    let mut options = ModelOptions {
        linear: LinearOptions {
            device: Device::Cpu,
            dtype: config.dtype,
            activation_quant: config.activation_quant,
            kv_cache: config.kv_cache,
            fp8_matmul: config.fp8_matmul,
            fused_fp8_scales: config.fused_fp8_scales,
        },
        max_seq_len: max_input_tokens,
        attention: config.attention,
    };
    let tokenizer = TextTokenizer::load(dir)?;
    let served = Source::open(dir, model_config)?;
    let reference = match &config.reference {
        None => None,
        Some(r) => {
            let dir = &r.model_dir;
            let open = || -> Result<Source, AppError> {
                check_model_dir(dir)?;
                let reference_config = ModelConfig::from_dir(dir)?;
                Source::open(dir, reference_config)
            };
            Some((open().map_err(of_the_reference)?, r))
        }
    };
    let mut replicas = Vec::new();
    // A default --max-input-tokens may be lowered to what the first replica's memory admits;
    // every other model must then fit at that length.
    let mut explicit = config.max_input_tokens.is_some();
    for (index, devices) in config.device.replicas.iter().enumerate() {
        let split = config.layer_split.as_deref();
        let model = served.load(devices, split, &options, config, explicit)?;
        options.max_seq_len = model.model.options().max_seq_len;
        explicit = true;
        let reference = match &reference {
            None => None,
            Some((source, r)) => {
                let reference_options = ModelOptions {
                    linear: LinearOptions {
                        dtype: r.dtype,
                        // the KV-cache flags are the served model's (the simulation is what
                        // /kld measures); a reference's own kv_cache_scheme is emulated
                        kv_cache: Default::default(),
                        fp8_matmul: config.fp8_matmul,
                        ..options.linear.clone()
                    },
                    ..options.clone()
                };
                let placed = source
                    .load(
                        &r.device.replicas[index],
                        r.layer_split.as_deref(),
                        &reference_options,
                        config,
                        true,
                    )
                    .map_err(of_the_reference)?;
                check_same_vocabulary(&model.model, &tokenizer, &placed.model, &r.model_dir)?;
                Some(placed)
            }
        };
        log_placement(index, "model", &model);
        if let Some(r) = &reference {
            log_placement(index, "reference", r);
        }
        replicas.push(LoadedReplica { model, reference });
    }
    enable_peer_access(&replicas)?;
    let checkpoint_sha256 = crate::checkpoint::fingerprint(dir)?;
    let reference_checkpoint_sha256 = config
        .reference
        .as_ref()
        .map(|r| {
            crate::checkpoint::fingerprint(&r.model_dir).map_err(|e| of_the_reference(e.into()))
        })
        .transpose()?;
    Ok(Loaded {
        replicas,
        tokenizer,
        max_input_tokens: options.max_seq_len,
        checkpoint_sha256,
        reference_checkpoint_sha256,
    })
}

/// An opened checkpoint and its config, loaded once per replica.
struct Source {
    dir: std::path::PathBuf,
    config: ModelConfig,
    ckpt: Checkpoint,
}

impl Source {
    fn open(dir: &Path, config: ModelConfig) -> Result<Self, AppError> {
        Ok(Self {
            dir: dir.to_path_buf(),
            config,
            ckpt: Checkpoint::open(dir)?,
        })
    }

    /// The model as pipeline stages on `devices` (one stage each): `split` layers per stage,
    /// or the split that balances each device's weights and expected activation peak. The
    /// memory plan refuses a stage whose expected peak passes what its device may hold, saying
    /// what would fit; unless `explicit`, it lowers `options.max_seq_len` to that instead.
    fn load(
        &self,
        devices: &[DeviceName],
        split: Option<&[usize]>,
        options: &ModelOptions,
        config: &Config,
        explicit: bool,
    ) -> Result<Placed, AppError> {
        let opened: Vec<Device> = devices.iter().map(open_device).collect::<Result<_, _>>()?;
        let names = devices
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(",");
        let placement_error = |e: placement::PlacementError| AppError::Placement {
            model: self.dir.display().to_string(),
            devices: names.clone(),
            message: e.to_string(),
        };
        let dtype = options.linear.dtype;
        let flash = config.attention != AttentionKernel::Materialized
            && self.config.flash_attention_possible()
            && opened.iter().all(|d| {
                crate::ops::flash_attention_available(d, self.config.attention_head_dim(), dtype)
            });
        let plan = |max_seq: usize| {
            let inputs = PlacementInputs {
                config: &self.config,
                ckpt: &self.ckpt,
                dtype,
                batch_tokens: config.batch.max_batch_tokens,
                max_seq,
                flash,
            };
            placement::plan_on(&inputs, &opened, split).map_err(placement_error)
        };
        let limits =
            placement::memory_limits(&opened, config.max_memory).map_err(placement_error)?;
        let mut options = options.clone();
        let mut plans = plan(options.max_seq_len)?;
        if let Some(k) = placement::first_over(&plans, &limits) {
            // The longest sequences that fit: the expected peak grows with the length.
            let (mut fits, mut over) = (0, options.max_seq_len);
            while over - fits > 1 {
                let mid = fits + (over - fits) / 2;
                match placement::first_over(&plan(mid)?, &limits) {
                    None => fits = mid,
                    Some(_) => over = mid,
                }
            }
            let message = memory_message(&plans[k], &devices[k], limits[k], &options, config, fits);
            if explicit || fits == 0 {
                return Err(AppError::Memory {
                    model: self.dir.display().to_string(),
                    message,
                });
            }
            tracing::warn!(
                max_input_tokens = fits,
                "{message}: lowered the default to it"
            );
            options.max_seq_len = fits;
            plans = plan(fits)?;
        }
        let stages = opened
            .into_iter()
            .zip(&plans)
            .map(|(device, plan)| (device, plan.layers.clone()))
            .collect();
        let model =
            Model::from_checkpoint_placed(self.config.clone(), &self.ckpt, &options, stages)?;
        Ok(Placed {
            model,
            stages: devices.iter().copied().zip(plans).collect(),
        })
    }
}

/// Why a stage does not fit, and what would: `fits` tokens per sequence (0: not even one).
fn memory_message(
    plan: &StagePlan,
    device: &DeviceName,
    limit: Option<u64>,
    options: &ModelOptions,
    config: &Config,
    fits: usize,
) -> String {
    let gib = |b: u64| format!("{:.2} GiB", b as f64 / GIB);
    let source = match config.max_memory {
        Some(_) => "--max-memory-gib",
        None if matches!(device, DeviceName::Cpu) => "the host's available memory",
        None => "the GPU's memory less 8 %",
    };
    let what_fits = match fits {
        0 => format!(
            "not even 1-token sequences fit; lower --max-batch-tokens ({}) or add devices",
            config.batch.max_batch_tokens
        ),
        n => format!("--max-input-tokens {n} would fit"),
    };
    format!(
        "layers {}..{} on {device} are expected to peak at {} (weights {}, activations for \
         sequences of up to {} tokens (--max-input-tokens) in batches of {} \
         (--max-batch-tokens)), over the {} it may hold ({source}); {what_fits}",
        plan.layers.start,
        plan.layers.end,
        gib(plan.expected_peak),
        gib(plan.weight_bytes),
        options.max_seq_len,
        config.batch.max_batch_tokens,
        gib(limit.unwrap_or(0)),
    )
}

fn log_placement(replica: usize, which: &str, placed: &Placed) {
    for (k, (device, plan)) in placed.stages.iter().enumerate() {
        tracing::info!(
            replica,
            which,
            stage = k,
            %device,
            layers = %format!("{}..{}", plan.layers.start, plan.layers.end),
            weight_gib = %format!("{:.3}", plan.weight_bytes as f64 / GIB),
            expected_peak_gib = %format!("{:.3}", plan.expected_peak as f64 / GIB),
            "placement"
        );
    }
}

const GIB: f64 = (1u64 << 30) as f64;

/// Direct peer-to-peer copies between the GPUs the models run on, where the hardware allows.
fn enable_peer_access(replicas: &[LoadedReplica]) -> Result<(), AppError> {
    let mut devices = Vec::new();
    for r in replicas {
        for placed in std::iter::once(&r.model).chain(&r.reference) {
            devices.extend((0..placed.model.stage_count()).map(|k| placed.model.stage_device(k)));
        }
    }
    let pairs = crate::device::enable_peer_access(&devices).map_err(|e| AppError::Device {
        device: "peer access".into(),
        message: e.to_string(),
    })?;
    if !pairs.is_empty() {
        tracing::info!(?pairs, "peer-to-peer access between GPUs");
    }
    Ok(())
}

/// A load error met while loading the reference model, said to be the reference's.
fn of_the_reference(error: AppError) -> AppError {
    match error {
        AppError::Load(e) => AppError::ReferenceLoad(e),
        other => other,
    }
}

fn open_device(name: &DeviceName) -> Result<Device, AppError> {
    match *name {
        DeviceName::Cpu => Ok(Device::Cpu),
        DeviceName::Cuda(id) => crate::device::cuda(id).map_err(|e| AppError::Device {
            device: name.to_string(),
            message: e.to_string(),
        }),
    }
}

/// A divergence is only meaningful between distributions over the same tokens.
fn check_same_vocabulary(
    model: &Model,
    tokenizer: &TextTokenizer,
    reference: &Model,
    reference_dir: &Path,
) -> Result<(), AppError> {
    let (ours, theirs) = (model.config().vocab_size, reference.config().vocab_size);
    let difference = if ours != theirs {
        Some(format!("vocab_size {ours} vs {theirs} in config.json"))
    } else {
        tokenizer.difference(&TextTokenizer::load(reference_dir)?)
    };
    match difference {
        None => Ok(()),
        Some(difference) => Err(AppError::Reference {
            dir: reference_dir.display().to_string(),
            message: format!(
                "its vocabulary differs from the served model's ({difference}); a \
                 KL-divergence needs the same tokens on both sides"
            ),
        }),
    }
}

/// `/info`: formats and activation quantization per projection type, bits per weight, where
/// the layers are, and the same of the reference model.
pub fn model_info(loaded: &Loaded, config: &Config, limits: Limits) -> ModelInfo {
    let first = &loaded.replicas[0];
    let model = &first.model.model;
    let weights = WeightSummary::of(model);
    let cfg = model.config();
    let placement = |which: fn(&LoadedReplica) -> Option<&Placed>| -> Vec<ReplicaPlacement> {
        loaded
            .replicas
            .iter()
            .enumerate()
            .filter_map(|(replica, r)| {
                which(r).map(|placed| ReplicaPlacement {
                    replica,
                    stages: placed
                        .stages
                        .iter()
                        .map(|(device, plan)| StagePlacement {
                            device: device.to_string(),
                            first_layer: plan.layers.start,
                            layers: plan.layers.len(),
                            weight_bytes: plan.weight_bytes,
                            expected_peak_bytes: plan.expected_peak,
                        })
                        .collect(),
                })
            })
            .collect()
    };
    ModelInfo {
        model: config.served_model_name.clone(),
        architecture: cfg.architecture.hf_name().to_string(),
        vocab_size: cfg.vocab_size,
        num_layers: cfg.num_layers,
        hidden_size: cfg.hidden_size,
        formats: weights.formats,
        activation_quant: weights.activation_quant,
        activation_quant_mode: match config.activation_quant {
            crate::quant::ActivationQuantMode::Emulate => "emulate".into(),
            crate::quant::ActivationQuantMode::Off => "off".into(),
        },
        kv_cache: KvCacheQdq::describe(
            cfg.quantization_config
                .as_ref()
                .and_then(|q| QuantizationConfig::parse(q).ok())
                .and_then(|q| q.kv_cache)
                .as_ref(),
            config.kv_cache,
        ),
        kv_cache_quant_mode: config.kv_cache.flag_values().0.into(),
        kv_cache_dtype: config.kv_cache.flag_values().1.into(),
        bits_per_weight: weights.bits_per_weight,
        attention: match model.options().attention {
            AttentionKernel::Flash => "flash".into(),
            _ => "materialized".into(),
        },
        dtype: dtype_name(config.dtype).into(),
        devices: config.device.names(),
        placement: placement(|r| Some(&r.model)),
        limits,
        version: env!("CARGO_PKG_VERSION").into(),
        checkpoint_sha256: Some(loaded.checkpoint_sha256.clone()),
        reference: first
            .reference
            .as_ref()
            .zip(config.reference.as_ref())
            .map(|(placed, r)| {
                let weights = WeightSummary::of(&placed.model);
                ReferenceInfo {
                    model: r.name.clone(),
                    architecture: placed.model.config().architecture.hf_name().to_string(),
                    formats: weights.formats,
                    bits_per_weight: weights.bits_per_weight,
                    devices: r.device.names(),
                    placement: placement(|r| r.reference.as_ref()),
                    dtype: Some(dtype_name(r.dtype).into()),
                    num_layers: placed.model.config().num_layers,
                    hidden_size: placed.model.config().hidden_size,
                    checkpoint_sha256: loaded.reference_checkpoint_sha256.clone(),
                }
            }),
    }
}

/// Formats and activation quantization per projection type, and the average stored bits per
/// weight of the decoder Linears.
struct WeightSummary {
    formats: BTreeMap<String, String>,
    activation_quant: BTreeMap<String, String>,
    bits_per_weight: f64,
}

impl WeightSummary {
    fn of(model: &Model) -> Self {
        let mut formats: BTreeMap<String, Vec<String>> = BTreeMap::new();
        let mut activation: BTreeMap<String, Vec<String>> = BTreeMap::new();
        let (mut bits, mut weights) = (0.0f64, 0.0f64);
        for (name, linear) in model.linears() {
            let kind = name.rsplit('.').next().unwrap_or(&name).to_string();
            let w = linear.weight();
            push_unique(formats.entry(kind.clone()).or_default(), w.describe());
            if let Some(qdq) = linear.activation() {
                // How it runs is part of what the numbers are (bf16 sums differ).
                let how = match linear.fp8_tensor_cores_summary() {
                    Some(cores) => format!("{}, {cores}", qdq.describe()),
                    None => qdq.describe().into(),
                };
                push_unique(activation.entry(kind.clone()).or_default(), how);
            }
            if kind != "lm_head" {
                let (out, inp) = w.shape();
                let n = (out * inp) as f64;
                bits += w.bits_per_weight() * n;
                weights += n;
            }
        }
        let join = |m: BTreeMap<String, Vec<String>>| -> BTreeMap<String, String> {
            m.into_iter().map(|(k, v)| (k, v.join("; "))).collect()
        };
        Self {
            formats: join(formats),
            activation_quant: join(activation),
            bits_per_weight: if weights > 0.0 { bits / weights } else { 0.0 },
        }
    }
}

fn push_unique(list: &mut Vec<String>, item: String) {
    if !list.contains(&item) {
        list.push(item);
    }
}

pub fn dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        _ => "f32",
    }
}
