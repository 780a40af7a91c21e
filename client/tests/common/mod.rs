//! Mock ExactScore servers for the client tests (axum on 127.0.0.1:0).
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use exactscore_api::{
    ErrorBody, Health, Limits, ModelInfo, ScoreRequest, ScoreResponse, SequenceScore, TextInput,
    TokenizeRequest, TokenizeResponse, TokenizerInfo, TokensInput, Usage,
};

/// Serve `app` on an ephemeral loopback port; returns the base URL.
pub async fn spawn(app: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(listener, app).await.unwrap();
    });
    format!("http://{addr}")
}

pub fn tokenizer_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/llama-dense-bf16/tokenizer.json")
}

pub fn tokenizer() -> tokenizers::Tokenizer {
    tokenizers::Tokenizer::from_file(tokenizer_path()).unwrap()
}

/// The fake model: log p(token) = -(id % 7) / 10, whatever the context.
pub fn fake_logprob(id: u32) -> f32 {
    -((id % 7) as f32) / 10.0
}

pub fn error(status: StatusCode, kind: &str, msg: &str) -> Response {
    (
        status,
        Json(ErrorBody {
            error: msg.into(),
            kind: kind.into(),
            field: None,
            rule: None,
            value: None,
        }),
    )
        .into_response()
}

pub struct Fake {
    pub api_key: Option<String>,
    pub tokenizer: tokenizers::Tokenizer,
    pub tokenizer_json: Vec<u8>,
    pub score_calls: AtomicUsize,
    pub scored_windows: std::sync::Mutex<Vec<usize>>,
    /// Answer 429 (Retry-After: 0) to every n-th /score call (0 = never).
    pub throttle_every: usize,
    /// What /info answers ([`model_info`] unless a test changes it).
    pub info: std::sync::Mutex<ModelInfo>,
}

impl Fake {
    pub fn new(api_key: Option<&str>) -> Arc<Self> {
        Arc::new(Self {
            api_key: api_key.map(String::from),
            tokenizer: tokenizer(),
            tokenizer_json: std::fs::read(tokenizer_path()).unwrap(),
            score_calls: AtomicUsize::new(0),
            scored_windows: Default::default(),
            throttle_every: 0,
            info: std::sync::Mutex::new(model_info()),
        })
    }

    pub fn throttled(every: usize) -> Arc<Self> {
        let mut f = Arc::into_inner(Self::new(None)).unwrap();
        f.throttle_every = every;
        Arc::new(f)
    }

    fn authorized(&self, h: &HeaderMap) -> bool {
        match &self.api_key {
            None => true,
            Some(k) => h
                .get("authorization")
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| v == format!("Bearer {k}")),
        }
    }
}

pub fn model_info() -> ModelInfo {
    ModelInfo {
        model: "fake-llama".into(),
        architecture: "LlamaForCausalLM".into(),
        vocab_size: 2000,
        num_layers: 2,
        hidden_size: 64,
        formats: BTreeMap::from([("q_proj".into(), "pack_quantized".into())]),
        activation_quant: BTreeMap::new(),
        activation_quant_mode: "off".into(),
        kv_cache: None,
        kv_cache_quant_mode: "emulate".into(),
        kv_cache_dtype: "auto".into(),
        attention: "materialized".into(),
        bits_per_weight: 4.25,
        dtype: "f32".into(),
        devices: vec!["cpu".into()],
        placement: Vec::new(),
        limits: Limits {
            max_input_tokens: 8192,
            max_batch_tokens: 8192,
            max_batch_requests: 8,
            max_queued_requests: 64,
            max_top_k: 20,
            max_request_cost: u64::MAX,
            max_response_bytes: u64::MAX,
        },
        version: "0.0.0-test".into(),
        reference: None,
        checkpoint_sha256: None,
    }
}

async fn score(
    State(f): State<Arc<Fake>>,
    h: HeaderMap,
    Json(req): Json<ScoreRequest>,
) -> Response {
    if !f.authorized(&h) {
        return error(StatusCode::UNAUTHORIZED, "unauthorized", "invalid API key");
    }
    let n = f.score_calls.fetch_add(1, Ordering::SeqCst) + 1;
    if f.throttle_every > 0 && n % f.throttle_every == 0 {
        return (
            StatusCode::TOO_MANY_REQUESTS,
            [("retry-after", "0")],
            Json(ErrorBody {
                error: "queue full".into(),
                kind: "overloaded".into(),
                field: None,
                rule: None,
                value: None,
            }),
        )
            .into_response();
    }
    let seqs: Vec<Vec<u32>> = match (req.tokens, req.text) {
        (Some(TokensInput::Single(t)), None) => vec![t.iter().map(|&x| x as u32).collect()],
        (Some(TokensInput::Batch(b)), None) => b
            .iter()
            .map(|t| t.iter().map(|&x| x as u32).collect())
            .collect(),
        (None, Some(TextInput::Single(s))) => vec![f
            .tokenizer
            .encode(s, req.add_special_tokens.unwrap_or(true))
            .unwrap()
            .get_ids()
            .to_vec()],
        _ => return error(StatusCode::UNPROCESSABLE_ENTITY, "validation", "bad input"),
    };
    let sequences = seqs
        .into_iter()
        .enumerate()
        .map(|(index, tokens)| {
            let lps: Vec<Option<f32>> = tokens
                .iter()
                .enumerate()
                .map(|(i, &t)| (i > 0).then(|| fake_logprob(t)))
                .collect();
            let sum: f64 = lps.iter().flatten().map(|&l| -(l as f64)).sum();
            let ns = tokens.len().saturating_sub(1);
            let mean = (ns > 0).then(|| sum / ns as f64);
            SequenceScore {
                index,
                token_strings: Some(
                    tokens
                        .iter()
                        .map(|&t| f.tokenizer.decode(&[t], false).unwrap_or_default())
                        .collect(),
                ),
                tokens,
                token_logprobs: Some(lps),
                sum_nll: sum,
                num_scored: ns,
                mean_nll: mean,
                perplexity: mean.map(f64::exp),
                top_k: None,
                greedy: None,
            }
        })
        .collect();
    Json(ScoreResponse {
        model: "fake-llama".into(),
        sequences,
        usage: Usage {
            input_tokens: 0,
            scored_tokens: 0,
            queue_ms: 0.0,
            compute_ms: 0.0,
        },
    })
    .into_response()
}

async fn tokenize(
    State(f): State<Arc<Fake>>,
    h: HeaderMap,
    Json(req): Json<TokenizeRequest>,
) -> Response {
    if !f.authorized(&h) {
        return error(StatusCode::UNAUTHORIZED, "unauthorized", "invalid API key");
    }
    let ids = f
        .tokenizer
        .encode(req.prompt, req.add_special_tokens.unwrap_or(true))
        .unwrap()
        .get_ids()
        .to_vec();
    Json(TokenizeResponse {
        count: ids.len(),
        tokens: ids,
        max_model_len: 8192,
    })
    .into_response()
}

/// A fake server whose /score answers with [`fake_logprob`].
pub fn fake_app(f: Arc<Fake>) -> Router {
    Router::new()
        .route("/score", post(score))
        .route("/tokenize", post(tokenize))
        .route(
            "/tokenizer.json",
            get(|State(f): State<Arc<Fake>>| async move { f.tokenizer_json.clone() }),
        )
        .route(
            "/tokenizer_info",
            get(|| async {
                Json(TokenizerInfo {
                    tokenizer_class: "TokenizersBackend".into(),
                    bos_token: Some("<|begin_of_text|>".into()),
                    bos_token_id: Some(1992),
                    eos_token: Some("<|end_of_text|>".into()),
                    eos_token_id: Some(1993),
                    pad_token: None,
                    vocab_size: 2000,
                    model_max_length: 8192,
                    add_bos_token: true,
                })
            }),
        )
        .route(
            "/info",
            get(|State(f): State<Arc<Fake>>| async move { Json(f.info.lock().unwrap().clone()) }),
        )
        .route(
            "/health/ready",
            get(|| async {
                Json(Health {
                    status: "ready".into(),
                    replicas_out_of_rotation: Vec::new(),
                })
            }),
        )
        .with_state(f)
}
