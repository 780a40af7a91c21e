//! HTTP tests: the real router, queue and batcher over a fake engine, driven with `oneshot`.
//! One test per status code, and every error body checked for its field, rule and value.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{header, Request, StatusCode};
use axum::Router;
use exactscore_api::{ErrorBody, ScoreResponse};
use exactscore_server::app::{Server, StateParts};
use exactscore_server::config::HttpConfig;
use exactscore_server::engine::fake::{FakeEngine, GateHandle};
use exactscore_server::engine::BatchLimits;
use exactscore_server::http::{router, SharedState};
use exactscore_server::tokenizer::TextTokenizer;
use serde_json::{json, Value};
use tower::ServiceExt;

mod fake_app;

use fake_app::{fixture, info, MAX_INPUT};

struct Setup {
    api_key: Option<&'static str>,
    max_body_bytes: usize,
    max_queued: usize,
    warm: bool,
    request_timeout: Duration,
}

impl Default for Setup {
    fn default() -> Self {
        Self {
            api_key: None,
            max_body_bytes: 64 * 1024,
            max_queued: 8,
            warm: true,
            request_timeout: Duration::from_secs(30),
        }
    }
}

async fn app_with(engine: FakeEngine, setup: Setup) -> (Router, SharedState) {
    let parts = StateParts {
        info: info(setup.max_queued),
        tokenizer: Arc::new(TextTokenizer::load(&fixture()).unwrap()),
        http: HttpConfig {
            api_key: setup.api_key.map(str::to_string),
            metrics_without_auth: false,
            max_body_bytes: setup.max_body_bytes,
            request_timeout: setup.request_timeout,
            drain_timeout: Duration::from_secs(5),
            header_read_timeout: Duration::from_secs(30),
            body_read_timeout: Duration::from_secs(30),
        },
        batch: BatchLimits {
            max_batch_tokens: 256,
            max_batch_requests: 4,
        },
    };
    let server = Server::start(Box::new(engine), parts).unwrap();
    if setup.warm {
        server.warm_up().await.unwrap();
    }
    let state = server.state.clone();
    (router(state.clone()), state)
}

async fn app(setup: Setup) -> Router {
    app_with(FakeEngine::default(), setup).await.0
}

fn post(path: &str, body: impl Into<Body>) -> Request<Body> {
    Request::post(path)
        .header(header::CONTENT_TYPE, "application/json")
        .body(body.into())
        .unwrap()
}

fn get(path: &str) -> Request<Body> {
    Request::get(path).body(Body::empty()).unwrap()
}

async fn send(app: &Router, req: Request<Body>) -> (StatusCode, axum::http::HeaderMap, Vec<u8>) {
    let res = app.clone().oneshot(req).await.unwrap();
    let status = res.status();
    let headers = res.headers().clone();
    let body = axum::body::to_bytes(res.into_body(), usize::MAX)
        .await
        .unwrap();
    (status, headers, body.to_vec())
}

async fn error(app: &Router, req: Request<Body>, status: StatusCode) -> ErrorBody {
    let (got, _, body) = send(app, req).await;
    let text = String::from_utf8_lossy(&body).into_owned();
    assert_eq!(got, status, "{text}");
    serde_json::from_slice(&body).unwrap_or_else(|e| panic!("not an ErrorBody ({e}): {text}"))
}

/// A 422 for `body` naming `field`, `rule` and `value`.
async fn assert_422(app: &Router, body: Value, field: &str, rule: &str, value: Value) {
    let e = error(
        app,
        post("/score", body.to_string()),
        StatusCode::UNPROCESSABLE_ENTITY,
    )
    .await;
    assert_eq!(e.kind, "validation");
    assert_eq!(e.field.as_deref(), Some(field), "{body}: {e:?}");
    assert_eq!(e.rule.as_deref(), Some(rule), "{body}: {e:?}");
    assert_eq!(
        e.value.clone().unwrap_or(Value::Null),
        value,
        "{body}: {e:?}"
    );
}

#[tokio::test]
async fn score_200_tokens_single_and_batch_in_order() {
    let app = app(Setup::default()).await;
    let (status, _, body) = send(
        &app,
        post(
            "/score",
            json!({"tokens": [[5, 6, 7], [9, 8]], "top_k": 2, "return": {"greedy": true}})
                .to_string(),
        ),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
    let r: ScoreResponse = serde_json::from_slice(&body).unwrap();
    assert_eq!(r.sequences.len(), 2);
    let s0 = &r.sequences[0];
    assert_eq!((s0.index, s0.tokens.clone()), (0, vec![5, 6, 7]));
    let lp = s0.token_logprobs.clone().unwrap();
    assert_eq!(
        lp,
        vec![
            None,
            Some(FakeEngine::logprob(6)),
            Some(FakeEngine::logprob(7))
        ]
    );
    assert_eq!(s0.num_scored, 2);
    let expect = -(FakeEngine::logprob(6) as f64 + FakeEngine::logprob(7) as f64);
    assert!((s0.sum_nll - expect).abs() < 1e-9);
    assert!((s0.mean_nll.unwrap() - expect / 2.0).abs() < 1e-9);
    assert_eq!(
        s0.greedy.clone().unwrap(),
        vec![None, Some(false), Some(false)]
    );
    assert_eq!(s0.top_k.as_ref().unwrap().len(), 3);
    assert_eq!(s0.top_k.as_ref().unwrap()[0].len(), 2);
    assert_eq!(r.sequences[1].tokens, vec![9, 8]);
    assert_eq!(r.usage.input_tokens, 5);
    assert_eq!(r.usage.scored_tokens, 3);

    // Single list, versioned path.
    let (status, _, body) = send(
        &app,
        post("/v1/score", json!({"tokens": [1, 2]}).to_string()),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let r: ScoreResponse = serde_json::from_slice(&body).unwrap();
    assert_eq!(r.sequences[0].tokens, vec![1, 2]);
    assert!(r.sequences[0].top_k.is_none());
    assert!(r.sequences[0].greedy.is_none());
}

#[tokio::test]
async fn score_200_text_is_tokenized_with_bos() {
    let app = app(Setup::default()).await;
    let body = json!({"text": ["Hello world", "Hi"], "return": {"token_strings": true}});
    let (status, _, body) = send(&app, post("/score", body.to_string())).await;
    assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
    let r: ScoreResponse = serde_json::from_slice(&body).unwrap();
    assert_eq!(r.sequences[0].tokens[0], 1992, "BOS added by default");
    let strings = r.sequences[0].token_strings.clone().unwrap();
    assert_eq!(strings[0], "<|begin_of_text|>");
    assert_eq!(strings[1..].concat().trim(), "Hello world");

    let body = json!({"text": "Hi", "add_special_tokens": false});
    let (_, _, body) = send(&app, post("/score", body.to_string())).await;
    let r: ScoreResponse = serde_json::from_slice(&body).unwrap();
    assert_ne!(r.sequences[0].tokens[0], 1992);
}

#[tokio::test]
async fn status_400_malformed_json() {
    let app = app(Setup::default()).await;
    let e = error(
        &app,
        post("/score", "{\"tokens\": [1, 2"),
        StatusCode::BAD_REQUEST,
    )
    .await;
    assert_eq!(e.kind, "invalid_json");
    let e = error(&app, post("/tokenize", "not json"), StatusCode::BAD_REQUEST).await;
    assert_eq!(e.kind, "invalid_json");
}

#[tokio::test]
async fn status_401_missing_or_wrong_key_health_stays_open() {
    let app = app(Setup {
        api_key: Some("s3cret"),
        ..Setup::default()
    })
    .await;
    let body = json!({"tokens": [1, 2]}).to_string();
    let e = error(&app, post("/score", body.clone()), StatusCode::UNAUTHORIZED).await;
    assert_eq!(e.kind, "unauthorized");
    assert_eq!(e.field.as_deref(), Some("authorization"));
    assert_eq!(e.rule.as_deref(), Some("bearer_api_key"));
    let mut wrong = post("/score", body.clone());
    wrong
        .headers_mut()
        .insert(header::AUTHORIZATION, "Bearer s3crex".parse().unwrap());
    error(&app, wrong, StatusCode::UNAUTHORIZED).await;
    error(&app, get("/info"), StatusCode::UNAUTHORIZED).await;

    let mut right = post("/score", body);
    right
        .headers_mut()
        .insert(header::AUTHORIZATION, "Bearer s3cret".parse().unwrap());
    assert_eq!(send(&app, right).await.0, StatusCode::OK);
    assert_eq!(send(&app, get("/health/live")).await.0, StatusCode::OK);
    assert_eq!(send(&app, get("/health/ready")).await.0, StatusCode::OK);
}

#[tokio::test]
async fn status_413_body_too_large() {
    let app = app(Setup {
        max_body_bytes: 100,
        ..Setup::default()
    })
    .await;
    let ids: Vec<u32> = (0..200).collect();
    let e = error(
        &app,
        post("/score", json!({ "tokens": ids }).to_string()),
        StatusCode::PAYLOAD_TOO_LARGE,
    )
    .await;
    assert_eq!(e.kind, "payload_too_large");
    assert_eq!(e.field.as_deref(), Some("body"));
    assert_eq!(e.rule.as_deref(), Some("max_body_bytes"));
    assert_eq!(e.value, Some(json!(100)));
}

#[tokio::test]
async fn status_422_names_field_rule_and_value() {
    let app = app(Setup::default()).await;
    assert_422(
        &app,
        json!({"tokens": []}),
        "tokens",
        "non_empty",
        json!([]),
    )
    .await;
    assert_422(
        &app,
        json!({"tokens": [[1, 2], []]}),
        "tokens[1]",
        "non_empty",
        json!([]),
    )
    .await;
    assert_422(
        &app,
        json!({"tokens": [1, 2000]}),
        "tokens[1]",
        "below_vocab_size",
        json!(2000),
    )
    .await;
    assert_422(
        &app,
        json!({"tokens": [[1], [3, -4]]}),
        "tokens[1][1]",
        "non_negative",
        json!(-4),
    )
    .await;
    let long: Vec<u32> = vec![1; MAX_INPUT + 1];
    assert_422(
        &app,
        json!({ "tokens": long }),
        "tokens",
        "max_input_tokens",
        json!(MAX_INPUT + 1),
    )
    .await;
    let long_text = "word ".repeat(200);
    assert_422(
        &app,
        json!({ "text": [long_text] }),
        "text[0]",
        "max_input_tokens",
        json!(402),
    )
    .await;
    assert_422(
        &app,
        json!({"tokens": [1, 2], "top_k": 21}),
        "top_k",
        "range",
        json!(21),
    )
    .await;
    assert_422(
        &app,
        json!({"tokens": [1, 2], "top_k": -1}),
        "top_k",
        "range",
        json!(-1),
    )
    .await;
    assert_422(
        &app,
        json!({"tokens": [1], "text": "hi"}),
        "text",
        "mutually_exclusive",
        json!("hi"),
    )
    .await;
    assert_422(
        &app,
        json!({"top_k": 1}),
        "tokens",
        "required_one_of",
        Value::Null,
    )
    .await;
    assert_422(
        &app,
        json!({"text": "", "add_special_tokens": false}),
        "text",
        "non_empty",
        json!(""),
    )
    .await;
    // Well-formed JSON of the wrong shape: 422 with the path of the field.
    assert_422(
        &app,
        json!({"tokens": [1, 2], "top_k": "3"}),
        "top_k",
        "schema",
        Value::Null,
    )
    .await;
    assert_422(
        &app,
        json!({"tokens": [1, 2], "bogus": 1}),
        "bogus",
        "schema",
        Value::Null,
    )
    .await;
    let e = error(
        &app,
        post("/detokenize", json!({"tokens": [5, 99999]}).to_string()),
        StatusCode::UNPROCESSABLE_ENTITY,
    )
    .await;
    assert_eq!(
        (e.field.as_deref(), e.rule.as_deref(), e.value),
        (
            Some("tokens[1]"),
            Some("below_vocab_size"),
            Some(json!(99999))
        )
    );
}

/// The first request holds the only admission permit inside a gated batch: the next is 429.
#[tokio::test]
async fn status_429_queue_full_with_retry_after() {
    let (engine, gate): (FakeEngine, GateHandle) = FakeEngine::gated();
    let setup = Setup {
        max_queued: 1,
        warm: false,
        ..Setup::default()
    };
    let (app, state) = app_with(engine, setup).await;
    state.readiness.set_warm();
    let first = tokio::spawn({
        let app = app.clone();
        async move { send(&app, post("/score", json!({"tokens": [1, 2]}).to_string())).await }
    });
    let gate = tokio::task::spawn_blocking(move || {
        gate.wait_started();
        gate
    })
    .await
    .unwrap();
    let (status, headers, body) =
        send(&app, post("/score", json!({"tokens": [3, 4]}).to_string())).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(headers[header::RETRY_AFTER], "1");
    let e: ErrorBody = serde_json::from_slice(&body).unwrap();
    assert_eq!(e.kind, "overloaded");
    gate.release();
    assert_eq!(first.await.unwrap().0, StatusCode::OK);
}

/// A request whose batch is still computing when the time limit passes gets 504; its result is
/// discarded and the engine serves the next request normally.
#[tokio::test]
async fn status_504_request_timeout() {
    let (engine, gate): (FakeEngine, GateHandle) = FakeEngine::gated();
    let setup = Setup {
        warm: false,
        request_timeout: Duration::from_millis(300),
        ..Setup::default()
    };
    let (app, state) = app_with(engine, setup).await;
    state.readiness.set_warm();
    let e = error(
        &app,
        post("/score", json!({"tokens": [1, 2]}).to_string()),
        StatusCode::GATEWAY_TIMEOUT,
    )
    .await;
    assert_eq!(e.kind, "timeout");
    assert!(e.error.contains("300ms"), "{}", e.error);
    // One release for the abandoned batch, one for the next request's.
    gate.release();
    gate.release();
    assert_eq!(
        send(&app, post("/score", json!({"tokens": [3, 4]}).to_string()))
            .await
            .0,
        StatusCode::OK
    );
}

#[tokio::test]
async fn status_503_not_ready_then_draining() {
    let (app, state) = app_with(
        FakeEngine::default(),
        Setup {
            warm: false,
            ..Setup::default()
        },
    )
    .await;
    let body = json!({"tokens": [1, 2]}).to_string();
    let (status, headers, body_bytes) = send(&app, post("/score", body.clone())).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(headers.contains_key(header::RETRY_AFTER));
    let e: ErrorBody = serde_json::from_slice(&body_bytes).unwrap();
    assert_eq!(e.kind, "not_ready");
    let (status, _, ready) = send(&app, get("/health/ready")).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        serde_json::from_slice::<Value>(&ready).unwrap()["status"],
        "starting"
    );
    assert_eq!(send(&app, get("/health/live")).await.0, StatusCode::OK);

    state.readiness.set_warm();
    assert_eq!(
        send(&app, post("/score", body.clone())).await.0,
        StatusCode::OK
    );
    state.readiness.start_draining();
    assert_eq!(
        send(&app, post("/score", body)).await.0,
        StatusCode::SERVICE_UNAVAILABLE
    );
    let (_, _, ready) = send(&app, get("/health/ready")).await;
    assert_eq!(
        serde_json::from_slice::<Value>(&ready).unwrap()["status"],
        "draining"
    );
}

#[tokio::test]
async fn status_404_has_the_error_shape() {
    let app = app(Setup::default()).await;
    let e = error(&app, get("/nope"), StatusCode::NOT_FOUND).await;
    assert_eq!(e.kind, "not_found");
}

#[tokio::test]
async fn tokenizer_routes() {
    let app = app(Setup::default()).await;
    let (status, _, body) = send(
        &app,
        post("/tokenize", json!({"prompt": "Hello world"}).to_string()),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let t: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(t["tokens"][0], 1992);
    assert_eq!(t["count"], t["tokens"].as_array().unwrap().len());
    assert_eq!(t["max_model_len"], MAX_INPUT);

    let ids = t["tokens"].clone();
    let (_, _, body) = send(
        &app,
        post("/detokenize", json!({ "tokens": ids }).to_string()),
    )
    .await;
    let d: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(d["prompt"], "<|begin_of_text|>Hello world");

    let (_, _, body) = send(&app, get("/tokenizer_info")).await;
    let i: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(i["bos_token"], "<|begin_of_text|>");
    assert_eq!(i["eos_token"], "<|end_of_text|>");
    assert_eq!(i["add_bos_token"], true);

    let (status, _, body) = send(&app, get("/tokenizer.json")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        body,
        std::fs::read(fixture().join("tokenizer.json")).unwrap()
    );
}

#[tokio::test]
async fn info_models_metrics_openapi() {
    let app = app(Setup::default()).await;
    let (_, _, body) = send(&app, get("/v1/models")).await;
    let m: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(m["object"], "list");
    assert_eq!(m["data"][0]["id"], "fake");
    let (_, _, body) = send(&app, get("/info")).await;
    let i: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(i["limits"]["max_input_tokens"], MAX_INPUT);

    send(
        &app,
        post("/score", json!({"tokens": [1, 2, 3]}).to_string()),
    )
    .await;
    let (status, headers, body) = send(&app, get("/metrics")).await;
    assert_eq!(status, StatusCode::OK);
    assert!(headers[header::CONTENT_TYPE]
        .to_str()
        .unwrap()
        .starts_with("text/plain"));
    let text = String::from_utf8(body).unwrap();
    for name in [
        "exactscore_requests_total",
        "exactscore_batch_tokens_bucket",
        "exactscore_compute_seconds_bucket",
        "exactscore_queue_seconds_bucket",
        "exactscore_tokens_scored_total",
        "exactscore_queue_depth",
    ] {
        assert!(text.contains(name), "{name} missing from:\n{text}");
    }
    assert!(text.contains("route=\"/score\",status=\"200\""), "{text}");

    let (status, _, body) = send(&app, get("/openapi.json")).await;
    assert_eq!(status, StatusCode::OK);
    let doc: Value = serde_json::from_slice(&body).unwrap();
    assert!(doc["openapi"].as_str().unwrap().starts_with("3.1"));
    assert!(doc["paths"]["/score"]["post"].is_object());
}

// ---- /v1/completions --------------------------------------------------------------------

async fn completion(app: &Router, body: Value) -> Value {
    let (status, _, bytes) = send(app, post("/v1/completions", body.to_string())).await;
    let text = String::from_utf8_lossy(&bytes).into_owned();
    assert_eq!(status, StatusCode::OK, "{text}");
    serde_json::from_slice(&bytes).unwrap()
}

#[tokio::test]
async fn completions_echo_with_greedy_token_is_what_lm_eval_reads() {
    let app = app(Setup::default()).await;
    let body = json!({"prompt": [[5, 7, 9]], "echo": true, "logprobs": 1, "max_tokens": 1,
                      "temperature": 0, "seed": 1234, "model": "fake"});
    let r = completion(&app, body).await;
    let c = &r["choices"][0];
    let lp = &c["logprobs"];
    let got: Vec<Option<f32>> = lp["token_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().map(|f| f as f32))
        .collect();
    let expect = vec![
        None,
        Some(FakeEngine::logprob(7)),
        Some(FakeEngine::logprob(9)),
        Some(FakeEngine::logprob(0)), // the appended greedy token (the fake's argmax is 0)
    ];
    assert_eq!(got, expect);
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 4);
    assert_eq!(lp["text_offset"].as_array().unwrap().len(), 4);
    let top = lp["top_logprobs"].as_array().unwrap();
    assert!(top[0].is_null());
    // Each dict holds the top-1 and the actual token; lm-eval's is_greedy is max(dict) == lp.
    for (i, entry) in top.iter().enumerate().skip(1) {
        let max = entry
            .as_object()
            .unwrap()
            .values()
            .map(|v| v.as_f64().unwrap())
            .fold(f64::MIN, f64::max);
        let is_greedy = max == lp["token_logprobs"][i].as_f64().unwrap();
        assert_eq!(is_greedy, i == 3, "position {i}: {entry}");
    }
    assert_eq!(c["index"], 0);
    assert_eq!(c["finish_reason"], "length");
    assert_eq!(r["object"], "text_completion");
    assert_eq!(
        r["usage"],
        json!({"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4})
    );
}

#[tokio::test]
async fn completions_batches_text_prompts_in_order_without_bos() {
    let app = app(Setup::default()).await;
    let prompts = ["To be, or not", "to be", "that is the question"];
    let r = completion(
        &app,
        json!({"prompt": prompts, "echo": true, "logprobs": 0, "max_tokens": 0}),
    )
    .await;
    let tokenizer = TextTokenizer::load(&fixture()).unwrap();
    for (i, p) in prompts.iter().enumerate() {
        let c = &r["choices"][i];
        assert_eq!(c["index"], i);
        assert_eq!(c["text"], *p);
        let ids = tokenizer.encode(p, false).unwrap();
        let lps = c["logprobs"]["token_logprobs"].as_array().unwrap();
        assert_eq!(lps.len(), ids.len(), "no BOS, no appended token");
        assert!(lps[0].is_null());
        for (lp, id) in lps.iter().zip(&ids).skip(1) {
            assert_eq!(lp.as_f64().unwrap() as f32, FakeEngine::logprob(*id));
        }
    }
}

#[tokio::test]
async fn completions_without_echo_or_logprobs() {
    let app = app(Setup::default()).await;
    let r = completion(
        &app,
        json!({"prompt": "Hello", "max_tokens": 1, "temperature": 0.0}),
    )
    .await;
    assert!(r["choices"][0]["logprobs"].is_null());
    assert_eq!(r["usage"]["completion_tokens"], 1);
    let r = completion(
        &app,
        json!({"prompt": "Hello", "max_tokens": 0, "logprobs": 2}),
    )
    .await;
    assert_eq!(r["choices"][0]["text"], "");
    assert_eq!(r["choices"][0]["logprobs"]["tokens"], json!([]));
}

#[tokio::test]
async fn completions_refuse_what_a_scoring_server_cannot_do() {
    let app = app(Setup::default()).await;
    let base = json!({"prompt": [1, 2], "max_tokens": 1, "temperature": 0});
    let cases: Vec<(Value, &str, &str, Value)> = vec![
        (
            json!({"max_tokens": 2}),
            "max_tokens",
            "unsupported",
            json!(2),
        ),
        (
            json!({"max_tokens": null}),
            "max_tokens",
            "required",
            Value::Null,
        ),
        (
            json!({"temperature": 0.7}),
            "temperature",
            "unsupported",
            json!(0.7),
        ),
        (
            json!({"temperature": null}),
            "temperature",
            "required",
            Value::Null,
        ),
        (json!({"n": 2}), "n", "unsupported", json!(2)),
        (
            json!({"stream": true}),
            "stream",
            "unsupported",
            json!(true),
        ),
        (
            json!({"stop": ["\n"]}),
            "stop",
            "unsupported",
            json!(["\n"]),
        ),
        (json!({"logprobs": 21}), "logprobs", "range", json!(21)),
        (
            json!({"model": "other"}),
            "model",
            "served_model",
            json!("other"),
        ),
        (
            json!({"prompt": [1, 2000]}),
            "prompt[1]",
            "below_vocab_size",
            json!(2000),
        ),
        (
            json!({"prompt": [[1], [-3]]}),
            "prompt[1][0]",
            "non_negative",
            json!(-3),
        ),
        (json!({"prompt": null}), "prompt", "required", Value::Null),
    ];
    for (patch, field, rule, value) in cases {
        let mut body = base.clone();
        for (k, v) in patch.as_object().unwrap() {
            body[k] = v.clone();
        }
        let e = error(
            &app,
            post("/v1/completions", body.to_string()),
            StatusCode::UNPROCESSABLE_ENTITY,
        )
        .await;
        assert_eq!(e.field.as_deref(), Some(field), "{body}: {e:?}");
        assert_eq!(e.rule.as_deref(), Some(rule), "{body}: {e:?}");
        assert_eq!(
            e.value.clone().unwrap_or(Value::Null),
            value,
            "{body}: {e:?}"
        );
    }
    // Unknown parameters are refused, not ignored.
    let mut body = base.clone();
    body["best_of"] = json!(3);
    let e = error(
        &app,
        post("/v1/completions", body.to_string()),
        StatusCode::UNPROCESSABLE_ENTITY,
    )
    .await;
    assert!(e.error.contains("best_of"), "{e:?}");
}

// ---- non-finite output (issue 27) -------------------------------------------------------

fn numerical_errors(metrics: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix("exactscore_numerical_errors_total "))
        .map_or(0.0, |v| v.parse().unwrap())
}

/// A NaN in a sequence's output (the fake model's log p of token 1999, as a real model's is
/// when its logits overflow) is a 500 `numerical` naming the sequence and position on every
/// scoring route, counted in `/metrics`; it was a 200 with `null` logprobs. The other
/// sequences of its batch are unaffected: they are answered in their own requests.
#[tokio::test]
async fn status_500_numerical_names_sequence_and_position() {
    let nan = FakeEngine::NAN_TOKEN;
    let parts = StateParts {
        info: exactscore_api::ModelInfo {
            reference: Some(exactscore_api::ReferenceInfo {
                model: "fake-reference".into(),
                architecture: "LlamaForCausalLM".into(),
                formats: Default::default(),
                bits_per_weight: 16.0,
                devices: vec!["cpu".into()],
                placement: Vec::new(),
                dtype: None,
                num_layers: 0,
                hidden_size: 0,
                checkpoint_sha256: None,
            }),
            ..info(8)
        },
        tokenizer: Arc::new(TextTokenizer::load(&fixture()).unwrap()),
        http: HttpConfig {
            api_key: None,
            metrics_without_auth: false,
            max_body_bytes: 64 * 1024,
            request_timeout: Duration::from_secs(30),
            drain_timeout: Duration::from_secs(5),
            header_read_timeout: Duration::from_secs(30),
            body_read_timeout: Duration::from_secs(30),
        },
        batch: BatchLimits {
            max_batch_tokens: 256,
            max_batch_requests: 4,
        },
    };
    let server = Server::start(Box::new(FakeEngine::default()), parts).unwrap();
    server.warm_up().await.unwrap();
    let app = router(server.state.clone());
    let before = numerical_errors(&String::from_utf8(send(&app, get("/metrics")).await.2).unwrap());
    // Sequence 1, the distribution after token 2 (which predicts the NaN token).
    for (path, body) in [
        ("/score", json!({"tokens": [[1, 2, 3], [4, 5, 6, nan, 7]]})),
        (
            "/v1/score",
            json!({"tokens": [[1, 2, 3], [4, 5, 6, nan, 7]], "top_k": 2}),
        ),
        ("/kld", json!({"tokens": [[1, 2, 3], [4, 5, 6, nan, 7]]})),
    ] {
        let e = error(
            &app,
            post(path, body.to_string()),
            StatusCode::INTERNAL_SERVER_ERROR,
        )
        .await;
        assert_eq!(e.kind, "numerical", "{path}");
        assert_eq!(e.field.as_deref(), Some("sequences[1]"), "{path}");
        assert_eq!(e.rule.as_deref(), Some("finite"), "{path}");
        assert_eq!(
            e.value,
            Some(json!({"sequence": 1, "position": 2})),
            "{path}"
        );
        assert!(
            e.error.contains("sequence 1") && e.error.contains("position 2"),
            "{}",
            e.error
        );
    }
    let e = error(
        &app,
        post(
            "/v1/completions",
            json!({"prompt": [1, nan], "echo": true, "logprobs": 1, "max_tokens": 0}).to_string(),
        ),
        StatusCode::INTERNAL_SERVER_ERROR,
    )
    .await;
    assert_eq!(
        (e.kind.as_str(), e.value),
        ("numerical", Some(json!({"sequence": 0, "position": 0})))
    );
    // The same sequences without the token: 200.
    let (status, _, _) = send(
        &app,
        post(
            "/score",
            json!({"tokens": [[1, 2, 3], [4, 5, 6, 8, 7]]}).to_string(),
        ),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let after = numerical_errors(&String::from_utf8(send(&app, get("/metrics")).await.2).unwrap());
    assert_eq!(after - before, 4.0);
}

// ---- headers and body encodings (issue 27) ------------------------------------------------

fn with_auth(mut req: Request<Body>, values: &[&str]) -> Request<Body> {
    for v in values {
        req.headers_mut()
            .append(header::AUTHORIZATION, v.parse().unwrap());
    }
    req
}

/// The auth scheme is case-insensitive (RFC 9110 §11.1; was 401 for `bearer`); two
/// `Authorization` headers are a 400, whichever of them is right (was: the first one won).
#[tokio::test]
async fn auth_scheme_is_case_insensitive_and_a_repeated_header_is_400() {
    let app = app(Setup {
        api_key: Some("s3cret"),
        ..Setup::default()
    })
    .await;
    let body = json!({"tokens": [1, 2]}).to_string();
    for scheme in ["Bearer", "bearer", "BEARER", "bEaReR"] {
        let req = with_auth(post("/score", body.clone()), &[&format!("{scheme} s3cret")]);
        assert_eq!(send(&app, req).await.0, StatusCode::OK, "{scheme}");
        let req = with_auth(post("/score", body.clone()), &[&format!("{scheme} s3creT")]);
        error(&app, req, StatusCode::UNAUTHORIZED).await;
    }
    for pair in [
        ["Bearer s3cret", "Bearer s3cret"],
        ["Bearer s3cret", "Bearer wrong"],
        ["Bearer wrong", "Bearer s3cret"],
    ] {
        let e = error(
            &app,
            with_auth(post("/score", body.clone()), &pair),
            StatusCode::BAD_REQUEST,
        )
        .await;
        assert_eq!(e.kind, "invalid_header");
        assert_eq!(e.field.as_deref(), Some("authorization"));
        assert_eq!(e.rule.as_deref(), Some("single_header"));
        assert!(!e.error.contains("s3cret"), "{}", e.error);
    }
    // The probes stay open whatever the headers.
    let probe = with_auth(get("/health/ready"), &["Bearer a", "Bearer b"]);
    assert_eq!(send(&app, probe).await.0, StatusCode::OK);
}

/// A compressed body was a "malformed JSON" 400; now a 415 naming `content-encoding`.
/// `identity` is what no encoding means.
#[tokio::test]
async fn content_encoding_other_than_identity_is_415() {
    let app = app(Setup::default()).await;
    let body = json!({"tokens": [1, 2]}).to_string();
    for encoding in ["gzip", "br", "deflate", "identity, gzip"] {
        let mut req = post("/score", body.clone());
        req.headers_mut()
            .insert(header::CONTENT_ENCODING, encoding.parse().unwrap());
        let e = error(&app, req, StatusCode::UNSUPPORTED_MEDIA_TYPE).await;
        assert_eq!(e.kind, "unsupported_media_type");
        assert_eq!(e.field.as_deref(), Some("content-encoding"));
        assert_eq!(e.value, Some(json!(encoding)));
    }
    let mut req = post("/score", body);
    req.headers_mut()
        .insert(header::CONTENT_ENCODING, "Identity".parse().unwrap());
    assert_eq!(send(&app, req).await.0, StatusCode::OK);
}

/// A token id beyond i64 was "data did not match any variant of untagged enum TokensInput";
/// the error now names the element and what a token id is.
#[tokio::test]
async fn a_token_id_of_2_pow_64_is_named() {
    let app = app(Setup::default()).await;
    for (body, field) in [
        (r#"{"tokens": [1, 18446744073709551616]}"#, "tokens[1]"),
        (
            r#"{"tokens": [[1], [2, 18446744073709551615]]}"#,
            "tokens[1][1]",
        ),
        (r#"{"tokens": [1, 2.5]}"#, "tokens[1]"),
        (r#"{"text": ["a", 7]}"#, "text[1]"),
    ] {
        let e = error(&app, post("/score", body), StatusCode::UNPROCESSABLE_ENTITY).await;
        assert_eq!(e.field.as_deref(), Some(field), "{body}: {e:?}");
        assert!(!e.error.contains("untagged"), "{body}: {}", e.error);
    }
    let e = error(
        &app,
        post("/v1/completions", r#"{"prompt": [1, 1e30]}"#),
        StatusCode::UNPROCESSABLE_ENTITY,
    )
    .await;
    assert_eq!(e.field.as_deref(), Some("prompt[1]"), "{e:?}");
    assert!(e.error.contains("token id"), "{}", e.error);
}

#[tokio::test]
async fn stored_reference_routes_name_the_bad_entry() {
    let app = app(Setup::default()).await;
    let rows = |ids: Value, logprobs: Value, tail: Value| {
        json!({"sequences": [{"tokens": [1, 2, 3], "reference": {
            "k": 2, "ids": ids, "logprobs": logprobs, "tail_logmass": tail}}]})
    };
    for (body, field, rule) in [
        (
            rows(
                json!([5, 5, 1, 2]),
                json!([-1.0, -2.0, -1.0, -2.0]),
                json!([-1.0, null]),
            ),
            "sequences[0].reference.ids[1]",
            "stored_id",
        ),
        (
            rows(
                json!([5, 6, 1, 2]),
                json!([-1.0, -2.0, -2.0, -1.0]),
                json!([-1.0, -3.0]),
            ),
            "sequences[0].reference.logprobs[3]",
            "descending",
        ),
        (
            rows(
                json!([5, 6, 1]),
                json!([-1.0, -2.0, -2.0, -3.0]),
                json!([-1.0, -3.0]),
            ),
            "sequences[0].reference.ids",
            "length",
        ),
        (
            rows(
                json!([5, 6, 1, 2]),
                json!([-1.0, -2.0, -2.0, -3.0]),
                json!([-1.0, -3.0, -1.0]),
            ),
            "sequences[0].reference.tail_logmass",
            "length",
        ),
        (
            rows(
                json!([5, 6, 1, 2]),
                json!([-1.0, -2.0, -2.0, -3.0]),
                json!([0.5, -3.0]),
            ),
            "sequences[0].reference.tail_logmass[0]",
            "log_probability",
        ),
    ] {
        let e = error(
            &app,
            post("/kld/stored", body.to_string()),
            StatusCode::UNPROCESSABLE_ENTITY,
        )
        .await;
        assert_eq!(e.field.as_deref(), Some(field), "{body}: {e:?}");
        assert_eq!(e.rule.as_deref(), Some(rule), "{body}: {e:?}");
    }
    let e = error(
        &app,
        post(
            "/reference",
            json!({"tokens": [1, 2, 3], "k": 0}).to_string(),
        ),
        StatusCode::UNPROCESSABLE_ENTITY,
    )
    .await;
    assert_eq!(
        (e.field.as_deref(), e.rule.as_deref()),
        (Some("k"), Some("range"))
    );
}
