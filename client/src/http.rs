//! Typed async client over the ExactScore wire types, with retries.
//!
//! Retries (jittered exponential backoff, `Retry-After` honoured) happen on 429, 502, 503, 504
//! and on connection errors (the request never reached the server), except a 504 of the
//! server's own time limit (kind `timeout`), which the same request would hit again, and a 503
//! `out_of_memory` (the sequence did not fit even alone). The first request to a server that
//! finds nothing listening fails at once ([`ClientError::NoServer`]). Any other 4xx — notably a 422
//! validation error — is returned at once as [`ClientError::Api`] carrying the server's
//! [`ErrorBody`]; 401/403 become [`ClientError::Unauthorized`].

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use exactscore_api::{
    DetokenizeRequest, DetokenizeResponse, DiffRequest, DiffResponse, ErrorBody, Health,
    KldRequest, KldResponse, ModelInfo, ReturnOptions, ScoreRequest, ScoreResponse,
    SequenceDivergence, TextInput, TokenizeRequest, TokenizeResponse, TokenizerInfo, TokensInput,
};
use rand::Rng;
use reqwest::{Method, StatusCode};
use serde::{de::DeserializeOwned, Serialize};

/// Errors of one client call. `Display` is one line, fit for a CLI's error message.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("{url}: the server rejected the API key ({status}): {}", body.error)]
    Unauthorized {
        url: String,
        status: u16,
        body: Box<ErrorBody>,
    },
    #[error("{url}: {status} {}: {}{}", body.kind, body.error, field_suffix(body))]
    Api {
        url: String,
        status: u16,
        body: Box<ErrorBody>,
    },
    #[error("{url}: cannot connect: {message}")]
    Connect { url: String, message: String },
    /// The first request to a server found nothing listening: not retried, since a server
    /// that never answered is more likely absent than restarting.
    #[error(
        "{url}: no server answers there ({message}). Start one on the bundled tiny model with \
         `cargo run --release -p exactscore-server`, or point the client at a running server \
         (--server URL)"
    )]
    NoServer { url: String, message: String },
    #[error("{url}: request timed out after {timeout:?}")]
    Timeout { url: String, timeout: Duration },
    #[error("{url}: {message}")]
    Transport { url: String, message: String },
    #[error("{url}: unexpected response ({status}): {message}")]
    Decode {
        url: String,
        status: u16,
        message: String,
    },
    #[error("{last} (gave up after {attempts} attempts)")]
    RetriesExhausted {
        attempts: u32,
        last: Box<ClientError>,
    },
    #[error("invalid server URL {0:?}")]
    BadUrl(String),
    #[error("the API key (--api-key / EXACTSCORE_API_KEY) {0}")]
    BadKey(String),
}

fn field_suffix(body: &ErrorBody) -> String {
    match (&body.field, &body.rule) {
        (Some(f), Some(r)) => format!(" (field {f}: {r})"),
        (Some(f), None) => format!(" (field {f})"),
        _ => String::new(),
    }
}

impl ClientError {
    /// The server's error body, if the server answered with one.
    pub fn body(&self) -> Option<&ErrorBody> {
        match self {
            ClientError::Unauthorized { body, .. } | ClientError::Api { body, .. } => Some(body),
            ClientError::RetriesExhausted { last, .. } => last.body(),
            _ => None,
        }
    }

    /// HTTP status, when there was a response.
    pub fn status(&self) -> Option<u16> {
        match self {
            ClientError::Unauthorized { status, .. }
            | ClientError::Api { status, .. }
            | ClientError::Decode { status, .. } => Some(*status),
            ClientError::RetriesExhausted { last, .. } => last.status(),
            _ => None,
        }
    }
}

/// Retry policy: attempt `i` (0-based) waits `Retry-After` when the server sent one (capped by
/// `max_retry_after`), else `d/2 + U(0, d/2)` with `d = min(max_delay, base_delay · 2^i)`.
#[derive(Debug, Clone)]
pub struct RetryPolicy {
    /// Retries after the first attempt (0 = never retry).
    pub max_retries: u32,
    pub base_delay: Duration,
    pub max_delay: Duration,
    pub max_retry_after: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_retries: 8,
            base_delay: Duration::from_millis(250),
            max_delay: Duration::from_secs(20),
            max_retry_after: Duration::from_secs(120),
        }
    }
}

impl RetryPolicy {
    /// The wait before retry number `attempt` (0-based).
    pub fn backoff(&self, attempt: u32, retry_after: Option<Duration>) -> Duration {
        if let Some(ra) = retry_after {
            // A little jitter on top so that many clients told the same thing do not return in
            // lockstep.
            let jitter = rand::rng().random_range(0.0..0.1) * ra.as_secs_f64().max(0.05);
            return ra.min(self.max_retry_after) + Duration::from_secs_f64(jitter);
        }
        let exp = (self.base_delay.as_secs_f64() * 2f64.powi(attempt.min(30) as i32))
            .min(self.max_delay.as_secs_f64());
        let half = exp / 2.0;
        Duration::from_secs_f64(half + rand::rng().random_range(0.0..=half.max(0.0)))
    }
}

/// Client settings.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Base URL, e.g. `http://127.0.0.1:8080`.
    pub base_url: String,
    pub api_key: Option<String>,
    /// Whole-request timeout.
    pub timeout: Duration,
    pub connect_timeout: Duration,
    pub retry: RetryPolicy,
    /// Connect to this address instead of looking up the URL's host (the URL, its port and
    /// the `Host` header stay as they are). See [`crate::resolve`].
    pub connect_to: Option<SocketAddr>,
}

impl ClientConfig {
    pub fn new(base_url: impl Into<String>) -> Self {
        Self {
            base_url: base_url.into(),
            api_key: None,
            timeout: Duration::from_secs(600),
            connect_timeout: Duration::from_secs(10),
            retry: RetryPolicy::default(),
            connect_to: None,
        }
    }
}

/// Typed client of one ExactScore server. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Client {
    http: reqwest::Client,
    base: String,
    config: ClientConfig,
    /// Whether any request of this client (or a clone) got an answer: until one did, a refused
    /// connection fails at once ([`ClientError::NoServer`]) instead of being retried.
    reached: Arc<AtomicBool>,
}

enum Attempt<T> {
    Done(T),
    Retry(ClientError, Option<Duration>),
    Fail(ClientError),
}

impl Client {
    pub fn new(config: ClientConfig) -> Result<Self, ClientError> {
        let base = config.base_url.trim_end_matches('/').to_string();
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(ClientError::BadUrl(config.base_url.clone()));
        }
        let mut builder = reqwest::Client::builder()
            .timeout(config.timeout)
            .connect_timeout(config.connect_timeout)
            // The server closes a connection idle for --header-read-timeout-secs (default 30):
            // drop idle ones before that instead of racing its close.
            .pool_idle_timeout(std::time::Duration::from_secs(20));
        if let Some(addr) = config.connect_to {
            let url = reqwest::Url::parse(&base).map_err(|_| ClientError::BadUrl(base.clone()))?;
            let host = url
                .host_str()
                .ok_or_else(|| ClientError::BadUrl(base.clone()))?;
            builder = builder.resolve(host, addr);
        }
        let http = builder.build().map_err(|e| ClientError::Transport {
            url: base.clone(),
            message: e.to_string(),
        })?;
        if config
            .api_key
            .as_deref()
            .is_some_and(|k| k.trim() != k || k.is_empty())
        {
            return Err(ClientError::BadKey(
                "has leading or trailing white space (a newline from a file?) or is empty: \
                 strip it"
                    .into(),
            ));
        }
        if let Some(k) = config.api_key.as_deref() {
            if let Err(e) = reqwest::header::HeaderValue::from_str(&format!("Bearer {k}")) {
                return Err(ClientError::BadKey(format!(
                    "cannot be sent in an HTTP header: {e}"
                )));
            }
        }
        Ok(Self {
            http,
            base,
            config,
            reached: Arc::new(AtomicBool::new(false)),
        })
    }

    /// Base URL without a trailing slash.
    pub fn base_url(&self) -> &str {
        &self.base
    }

    /// The base URL, and the address it connects to when pinned (`http://name:8000 via
    /// 10.0.0.7:8000`): what reports and error messages call this server.
    pub fn label(&self) -> String {
        match self.config.connect_to {
            Some(addr) => format!("{} via {addr}", self.base),
            None => self.base.clone(),
        }
    }

    /// `POST /score` with any request.
    pub async fn score(&self, req: &ScoreRequest) -> Result<ScoreResponse, ClientError> {
        self.json(Method::POST, "/score", Some(req)).await
    }

    /// Score one token sequence; returns only per-token log-probabilities.
    pub async fn score_tokens(
        &self,
        tokens: &[u32],
    ) -> Result<exactscore_api::SequenceScore, ClientError> {
        let req = ScoreRequest {
            tokens: Some(TokensInput::Single(
                tokens.iter().map(|&t| i64::from(t)).collect(),
            )),
            top_k: Some(0),
            return_options: Some(ReturnOptions {
                token_logprobs: true,
                top_k: false,
                greedy: false,
                token_strings: false,
            }),
            ..Default::default()
        };
        let resp = self.score(&req).await?;
        self.only_sequence("/score", resp.sequences)
    }

    /// `POST /kld` with any request: divergences from the server's reference model.
    pub async fn kld(&self, req: &KldRequest) -> Result<KldResponse, ClientError> {
        self.json(Method::POST, "/kld", Some(req)).await
    }

    /// `POST /kld` for one token sequence: per-token divergences from the server's reference
    /// model.
    pub async fn kld_tokens(&self, tokens: &[u32]) -> Result<SequenceDivergence, ClientError> {
        let req = KldRequest {
            tokens: Some(TokensInput::Single(
                tokens.iter().map(|&t| i64::from(t)).collect(),
            )),
            ..Default::default()
        };
        let resp = self.kld(&req).await?;
        self.only_sequence("/kld", resp.sequences)
    }

    /// `POST /reference`: the served model's top-`k` rows and tail log-mass, as a stored
    /// reference.
    pub async fn reference(
        &self,
        req: &exactscore_api::ReferenceRequest,
    ) -> Result<exactscore_api::ReferenceResponse, ClientError> {
        self.json(Method::POST, "/reference", Some(req)).await
    }

    /// `POST /kld/stored`: the served model's divergence from a stored reference, bounded.
    pub async fn kld_stored(
        &self,
        req: &exactscore_api::StoredKldRequest,
    ) -> Result<exactscore_api::StoredKldResponse, ClientError> {
        self.json(Method::POST, "/kld/stored", Some(req)).await
    }

    /// `POST /diff`: the served model against the server's reference model, layer by layer.
    pub async fn diff(&self, req: &DiffRequest) -> Result<DiffResponse, ClientError> {
        self.json(Method::POST, "/diff", Some(req)).await
    }

    /// The answer to a one-sequence request, refusing any other count.
    fn only_sequence<T>(&self, route: &str, mut sequences: Vec<T>) -> Result<T, ClientError> {
        if sequences.len() != 1 {
            return Err(ClientError::Decode {
                url: self.shown(route),
                status: 200,
                message: format!("expected 1 sequence, got {}", sequences.len()),
            });
        }
        Ok(sequences.remove(0))
    }

    /// Score one text (tokenized by the server).
    pub async fn score_text(
        &self,
        text: &str,
        top_k: i64,
        options: ReturnOptions,
    ) -> Result<ScoreResponse, ClientError> {
        let req = ScoreRequest {
            text: Some(TextInput::Single(text.to_string())),
            top_k: Some(top_k),
            return_options: Some(options),
            ..Default::default()
        };
        self.score(&req).await
    }

    pub async fn tokenize(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<TokenizeResponse, ClientError> {
        let req = TokenizeRequest {
            prompt: text.to_string(),
            add_special_tokens: Some(add_special_tokens),
        };
        self.json(Method::POST, "/tokenize", Some(&req)).await
    }

    pub async fn detokenize(&self, tokens: &[u32]) -> Result<String, ClientError> {
        let req = DetokenizeRequest {
            tokens: tokens.iter().map(|&t| i64::from(t)).collect(),
        };
        let r: DetokenizeResponse = self.json(Method::POST, "/detokenize", Some(&req)).await?;
        Ok(r.prompt)
    }

    pub async fn tokenizer_info(&self) -> Result<TokenizerInfo, ClientError> {
        self.json::<(), _>(Method::GET, "/tokenizer_info", None)
            .await
    }

    /// The raw `tokenizer.json` the server uses.
    pub async fn tokenizer_json(&self) -> Result<Vec<u8>, ClientError> {
        self.request::<(), _>(Method::GET, "/tokenizer.json", None, |_, b| Ok(b.to_vec()))
            .await
    }

    pub async fn info(&self) -> Result<ModelInfo, ClientError> {
        self.json::<(), _>(Method::GET, "/info", None).await
    }

    /// `GET /health/ready` (retried while 503).
    pub async fn ready(&self) -> Result<Health, ClientError> {
        self.json::<(), _>(Method::GET, "/health/ready", None).await
    }

    fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    /// The URL as error messages show it: with the pinned address, if any.
    fn shown(&self, path: &str) -> String {
        match self.config.connect_to {
            Some(addr) => format!("{}{} via {addr}", self.base, path),
            None => self.url(path),
        }
    }

    async fn json<B: Serialize, T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
    ) -> Result<T, ClientError> {
        self.request(method, path, body, |url, bytes| {
            serde_json::from_slice(bytes).map_err(|e| ClientError::Decode {
                url: url.to_string(),
                status: 200,
                message: e.to_string(),
            })
        })
        .await
    }

    async fn request<B: Serialize, T>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
        parse: impl Fn(&str, &[u8]) -> Result<T, ClientError>,
    ) -> Result<T, ClientError> {
        let url = self.url(path);
        let shown = self.shown(path);
        let payload = match body {
            Some(b) => Some(serde_json::to_vec(b).map_err(|e| ClientError::Transport {
                url: shown.clone(),
                message: e.to_string(),
            })?),
            None => None,
        };
        let policy = &self.config.retry;
        let mut attempt = 0u32;
        loop {
            match self
                .attempt(&method, &url, &shown, payload.as_deref(), &parse)
                .await
            {
                Attempt::Done(v) => return Ok(v),
                Attempt::Fail(e) => return Err(e),
                Attempt::Retry(e, retry_after) => {
                    if attempt >= policy.max_retries {
                        return Err(if attempt == 0 {
                            e
                        } else {
                            ClientError::RetriesExhausted {
                                attempts: attempt + 1,
                                last: Box::new(e),
                            }
                        });
                    }
                    tokio::time::sleep(policy.backoff(attempt, retry_after)).await;
                    attempt += 1;
                }
            }
        }
    }

    async fn attempt<T>(
        &self,
        method: &Method,
        url: &str,
        shown: &str,
        payload: Option<&[u8]>,
        parse: &impl Fn(&str, &[u8]) -> Result<T, ClientError>,
    ) -> Attempt<T> {
        let mut rb = self.http.request(method.clone(), url);
        let url = shown;
        if let Some(key) = &self.config.api_key {
            rb = rb.bearer_auth(key);
        }
        if let Some(p) = payload {
            rb = rb
                .header(reqwest::header::CONTENT_TYPE, "application/json")
                .body(p.to_vec());
        }
        let resp = match rb.send().await {
            Ok(r) => r,
            Err(e) => return self.transport_error(url, e),
        };
        self.reached.store(true, Ordering::Relaxed);
        let status = resp.status();
        let retry_after = resp
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|s| s.trim().parse::<f64>().ok())
            .filter(|s| s.is_finite() && *s >= 0.0)
            .map(Duration::from_secs_f64);
        let bytes = match resp.bytes().await {
            Ok(b) => b,
            Err(e) => return self.transport_error(url, e),
        };
        if status.is_success() {
            return match parse(url, &bytes) {
                Ok(v) => Attempt::Done(v),
                Err(e) => Attempt::Fail(e),
            };
        }
        let body = Box::new(
            serde_json::from_slice::<ErrorBody>(&bytes).unwrap_or_else(|_| ErrorBody {
                error: String::from_utf8_lossy(&bytes).chars().take(200).collect(),
                kind: status
                    .canonical_reason()
                    .unwrap_or("error")
                    .to_lowercase()
                    .replace(' ', "_"),
                field: None,
                rule: None,
                value: None,
            }),
        );
        // The server's own time limit (504 `timeout`): the same request would run as long
        // again, so it is not retried (a 504 from a proxy in between still is).
        let own_time_limit = status == StatusCode::GATEWAY_TIMEOUT && body.kind == "timeout";
        // A 503 `out_of_memory` is sent only once the sequence failed in a batch of its own:
        // the same sequence would fail again.
        let cannot_fit = status == StatusCode::SERVICE_UNAVAILABLE && body.kind == "out_of_memory";
        let err = if status == StatusCode::UNAUTHORIZED || status == StatusCode::FORBIDDEN {
            ClientError::Unauthorized {
                url: url.to_string(),
                status: status.as_u16(),
                body,
            }
        } else {
            ClientError::Api {
                url: url.to_string(),
                status: status.as_u16(),
                body,
            }
        };
        match status.as_u16() {
            504 if own_time_limit => Attempt::Fail(err),
            503 if cannot_fit => Attempt::Fail(err),
            429 | 502 | 503 | 504 => Attempt::Retry(err, retry_after),
            _ => Attempt::Fail(err),
        }
    }

    fn transport_error<T>(&self, url: &str, e: reqwest::Error) -> Attempt<T> {
        let message = error_chain(&e);
        if e.is_timeout() {
            Attempt::Fail(ClientError::Timeout {
                url: url.to_string(),
                timeout: self.config.timeout,
            })
        } else if e.is_connect() && !self.reached.load(Ordering::Relaxed) {
            Attempt::Fail(ClientError::NoServer {
                url: self.label(),
                message: root_cause(&e),
            })
        } else if e.is_connect() {
            Attempt::Retry(
                ClientError::Connect {
                    url: url.to_string(),
                    message,
                },
                None,
            )
        } else {
            // The connection broke before a complete response: the server may have dropped
            // it (restart, drain). Scoring is idempotent, so retrying is safe.
            Attempt::Retry(
                ClientError::Transport {
                    url: url.to_string(),
                    message,
                },
                None,
            )
        }
    }
}

/// The innermost cause of `e` (`Connection refused (os error 111)`), on one line.
fn root_cause(e: &dyn std::error::Error) -> String {
    let mut cur = e;
    while let Some(c) = cur.source() {
        cur = c;
    }
    cur.to_string().replace('\n', " ")
}

/// `e: cause: cause` on one line.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let cs = c.to_string();
        if !s.contains(&cs) {
            s.push_str(": ");
            s.push_str(&cs);
        }
        cur = c.source();
    }
    s.replace('\n', " ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_bounds() {
        let p = RetryPolicy {
            max_retries: 3,
            base_delay: Duration::from_millis(100),
            max_delay: Duration::from_millis(1000),
            max_retry_after: Duration::from_secs(5),
        };
        for attempt in 0..10 {
            let d = p.backoff(attempt, None).as_secs_f64();
            let full = (0.1 * 2f64.powi(attempt as i32)).min(1.0);
            assert!(d >= full / 2.0 - 1e-9 && d <= full + 1e-9, "{attempt}: {d}");
        }
        let d = p.backoff(0, Some(Duration::from_secs(2))).as_secs_f64();
        assert!((2.0..=2.21).contains(&d), "{d}");
        let d = p.backoff(0, Some(Duration::from_secs(100))).as_secs_f64();
        assert!((5.0..=15.1).contains(&d), "{d}");
    }
}
