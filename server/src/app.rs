//! Assembly: model + tokenizer + engine + HTTP state from a [`Config`], warm-up, and serving
//! with graceful shutdown. Shared by `main` and the end-to-end tests.

use std::collections::BTreeMap;
use std::future::Future;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use candle_core::{DType, Device};
use exactscore_api::{Limits, ModelInfo, ReferenceInfo};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use crate::config::{Config, DeviceSpec, HttpConfig};
use crate::engine::batcher::EngineThread;
use crate::engine::{BatchLimits, Engine, EngineError, ModelEngine, Scheduler};
use crate::http::validate::MAX_TOP_K;
use crate::http::{self, AppState, Readiness, SharedState};
use crate::model::{checkpoint::LoadError, Model, ModelConfig, ModelOptions};
use crate::quant::LinearOptions;
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

impl Server {
    /// Starts the engine thread and batcher over any [`Engine`] (the fake one in HTTP tests).
    /// Not ready until [`Server::warm_up`].
    pub fn start(engine: Box<dyn Engine>, parts: StateParts) -> std::io::Result<Self> {
        let (scheduler, engine) = Scheduler::start(engine, parts.batch)?;
        let state = Arc::new(AppState {
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

    /// Loads the model named by `config` (and its reference model, if any) and starts it
    /// (blocking work runs off the runtime).
    pub async fn load(config: &Config) -> Result<Self, AppError> {
        let cfg = config.clone();
        let loaded = tokio::task::spawn_blocking(move || load_models(&cfg))
            .await
            .map_err(|e| AppError::Io(std::io::Error::other(e)))??;
        let limits = Limits {
            max_input_tokens: loaded.max_input_tokens,
            max_batch_tokens: config.batch.max_batch_tokens,
            max_batch_requests: config.batch.max_batch_requests,
            max_queued_requests: config.max_queued_requests,
            max_top_k: MAX_TOP_K,
        };
        let info = model_info(&loaded.model, loaded.reference.as_ref(), config, limits);
        let parts = StateParts {
            info,
            tokenizer: Arc::new(loaded.tokenizer),
            http: config.http.clone(),
            batch: config.batch,
        };
        let engine = ModelEngine {
            model: loaded.model,
            reference: loaded.reference,
        };
        Ok(Self::start(Box::new(engine), parts)?)
    }

    /// Runs one small batch through the whole path, then reports ready.
    pub async fn warm_up(&self) -> Result<(), AppError> {
        let bos = self.state.tokenizer.info().bos_token_id.unwrap_or(0);
        let tokens = vec![bos.min(self.state.info.vocab_size.saturating_sub(1) as u32); 2];
        let rx = self.state.scheduler.submit(tokens, 1);
        // Also the first check of the whole path's numerics: NaN or infinite logits (a weight
        // that overflows the compute dtype) fail the start.
        rx.await
            .unwrap_or(Err(EngineError::Stopped))
            .and_then(crate::engine::Computed::checked)?;
        self.state.readiness.set_warm();
        Ok(())
    }

    /// Serves until `shutdown` resolves, then drains: readiness turns 503 `draining` at once
    /// and new scoring requests are answered 503 while the listener stays open (so a load
    /// balancer sees the probe fail instead of a refused connection); once every admitted
    /// request has been answered, or `--drain-timeout-secs` has passed, the listener closes,
    /// the engine stops after its last batch and this returns.
    pub async fn serve(
        self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let readiness = self.state.readiness.clone();
        let scheduler = self.state.scheduler.clone();
        let admission = self.state.admission.clone();
        let all_permits = self.state.limits().max_queued_requests as u32;
        let drain_timeout = self.state.http.drain_timeout;
        let header_read_timeout = self.state.http.header_read_timeout;
        let (signalled_tx, signalled_rx) = tokio::sync::oneshot::channel::<Instant>();
        let app = http::router(self.state);
        let serve = http::serve::serve(listener, app, header_read_timeout);
        let serve = serve.with_graceful_shutdown(async move {
            shutdown.await;
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
                Err(_) => tracing::warn!(?drain_timeout, "drain timeout passed; closing"),
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
        let engine = self.engine;
        tokio::task::spawn_blocking(move || engine.join())
            .await
            .map_err(std::io::Error::other)?;
        tracing::info!("engine stopped");
        Ok(())
    }
}

/// What start-up loads from disk.
struct Loaded {
    model: Model,
    reference: Option<Model>,
    tokenizer: TextTokenizer,
    max_input_tokens: usize,
}

fn load_models(config: &Config) -> Result<Loaded, AppError> {
    let dir = &config.model_dir;
    let model_config = ModelConfig::from_json(&read(dir, "config.json")?)?;
    let max_input_tokens = config.resolve_max_input_tokens(model_config.max_position_embeddings);
    let options = |device: &DeviceSpec| -> Result<ModelOptions, AppError> {
        Ok(ModelOptions {
            linear: LinearOptions {
                device: open_device(device)?,
                dtype: config.dtype,
                activation_quant: config.activation_quant,
            },
            max_seq_len: max_input_tokens,
            attention: config.attention,
        })
    };
    let model = Model::load(dir, &options(&config.device)?)?;
    let tokenizer = TextTokenizer::load(dir)?;
    let reference = match &config.reference {
        None => None,
        Some(r) => {
            let reference = Model::load(&r.model_dir, &options(&r.device)?)?;
            check_same_vocabulary(&model, &tokenizer, &reference, &r.model_dir)?;
            Some(reference)
        }
    };
    Ok(Loaded {
        model,
        reference,
        tokenizer,
        max_input_tokens,
    })
}

/// The first device of `spec` (a model on several GPUs is refused by the config).
fn open_device(spec: &DeviceSpec) -> Result<Device, AppError> {
    match spec {
        DeviceSpec::Cpu => Ok(Device::Cpu),
        DeviceSpec::Cuda(ids) => {
            let id = ids.first().copied().unwrap_or(0);
            crate::device::cuda(id).map_err(|e| AppError::Device {
                device: format!("cuda:{id}"),
                message: e.to_string(),
            })
        }
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

fn read(dir: &Path, name: &str) -> Result<String, AppError> {
    let path = dir.join(name);
    std::fs::read_to_string(&path).map_err(|e| {
        AppError::Io(std::io::Error::new(
            e.kind(),
            format!("{}: {e}", path.display()),
        ))
    })
}

/// `/info`: formats and activation quantization per projection type, bits per weight, and the
/// same of the reference model.
pub fn model_info(
    model: &Model,
    reference: Option<&Model>,
    config: &Config,
    limits: Limits,
) -> ModelInfo {
    let weights = WeightSummary::of(model);
    let cfg = model.config();
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
        bits_per_weight: weights.bits_per_weight,
        attention: match model.options().attention {
            crate::model::AttentionKernel::Flash => "flash".into(),
            _ => "materialized".into(),
        },
        dtype: dtype_name(config.dtype).into(),
        devices: config.device.names(),
        limits,
        version: env!("CARGO_PKG_VERSION").into(),
        reference: reference.zip(config.reference.as_ref()).map(|(m, r)| {
            let weights = WeightSummary::of(m);
            ReferenceInfo {
                model: r.name.clone(),
                architecture: m.config().architecture.hf_name().to_string(),
                formats: weights.formats,
                bits_per_weight: weights.bits_per_weight,
                devices: r.device.names(),
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
                push_unique(
                    activation.entry(kind.clone()).or_default(),
                    qdq.describe().into(),
                );
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
