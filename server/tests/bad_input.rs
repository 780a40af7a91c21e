//! Hardening of the HTTP edge, over the real router, queue and batcher with the fake engine:
//!
//! * a generated suite of bad inputs over every field of every route (wrong JSON types,
//!   missing, empty, huge: 10^6 tokens and 10^5 sequences, out-of-range ids, invalid UTF-8,
//!   deep nesting, wrong content types, duplicate keys, wrong methods). Each case must get a
//!   4xx JSON [`ErrorBody`] that names the field, and after each one the server must still be
//!   ready and answer a valid request exactly as before. The number of cases is asserted.
//! * the API key: every route but `/health/*` (and `/metrics` with `--metrics-without-auth`)
//!   needs it, whatever the spelling of the path.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{header, Method, Request, StatusCode};
use axum::Router;
use exactscore_api::{ErrorBody, ModelInfo, ReferenceInfo};
use exactscore_server::app::{Server, StateParts};
use exactscore_server::config::HttpConfig;
use exactscore_server::engine::fake::FakeEngine;
use exactscore_server::engine::BatchLimits;
use exactscore_server::http::router;
use exactscore_server::tokenizer::TextTokenizer;
use serde_json::{json, Value};
use tower::ServiceExt;

mod fake_app;

use fake_app::{fixture, MAX_INPUT, VOCAB};

/// Large enough that 10^6 token ids (about 7 MB of JSON) reach validation.
const BIG_BODY: usize = 16 * 1024 * 1024;

async fn app(api_key: Option<&str>, metrics_without_auth: bool, max_body_bytes: usize) -> Router {
    let info = ModelInfo {
        // With a reference, `/kld` validates its body like every other route.
        reference: Some(ReferenceInfo {
            model: "fake-reference".into(),
            architecture: "LlamaForCausalLM".into(),
            formats: BTreeMap::new(),
            bits_per_weight: 16.0,
            devices: vec!["cpu".into()],
            placement: Vec::new(),
            dtype: Some("f32".into()),
            num_layers: 2,
            hidden_size: 256,
            checkpoint_sha256: None,
        }),
        ..fake_app::info(8)
    };
    let parts = StateParts {
        info,
        tokenizer: Arc::new(TextTokenizer::load(&fixture()).unwrap()),
        http: HttpConfig {
            api_key: api_key.map(str::to_string),
            metrics_without_auth,
            max_body_bytes,
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
    router(server.state.clone())
}

async fn send(app: &Router, req: Request<Body>) -> (StatusCode, header::HeaderMap, Vec<u8>) {
    let res = app.clone().oneshot(req).await.unwrap();
    let status = res.status();
    let headers = res.headers().clone();
    let body = axum::body::to_bytes(res.into_body(), usize::MAX)
        .await
        .unwrap();
    (status, headers, body.to_vec())
}

/// One bad request and what its error must name.
struct Case {
    label: String,
    method: Method,
    path: &'static str,
    content_type: Option<&'static str>,
    body: Vec<u8>,
    /// The error's `field` must be this or a path below it (`tokens` covers `tokens[3][1]`).
    field: &'static str,
}

impl Case {
    fn json(
        label: impl Into<String>,
        path: &'static str,
        body: Vec<u8>,
        field: &'static str,
    ) -> Self {
        Self {
            label: label.into(),
            method: Method::POST,
            path,
            content_type: Some("application/json"),
            body,
            field,
        }
    }

    fn request(&self, key: Option<&str>) -> Request<Body> {
        let mut b = Request::builder()
            .method(self.method.clone())
            .uri(self.path);
        if let Some(ct) = self.content_type {
            b = b.header(header::CONTENT_TYPE, ct);
        }
        if let Some(key) = key {
            b = b.header(header::AUTHORIZATION, format!("Bearer {key}"));
        }
        b.body(Body::from(self.body.clone())).unwrap()
    }
}

/// A route's JSON body: its valid base and, per field, the JSON kinds it accepts.
struct Route {
    path: &'static str,
    base: Value,
    fields: Vec<(&'static str, Kind)>,
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    /// Token ids: a list of integers (or, `batch`, a list of such lists); `empty_ok`: `[]`
    /// is valid (`/detokenize`).
    Ids {
        batch: bool,
        empty_ok: bool,
    },
    /// A completions prompt: ids, lists of ids, a text or texts.
    Prompt,
    /// Text: a string (or, `batch`, a list of strings); `empty_ok`: `""` is valid (`/score`
    /// adds BOS, so it has one token).
    Text {
        batch: bool,
        empty_ok: bool,
    },
    Bool,
    /// An integer with the allowed range (inclusive).
    Int(i64, i64),
    /// Any integer (`seed`).
    AnyInt,
    /// A number that must be 0 (`temperature` with `max_tokens` 1).
    Zero,
    Str,
    /// The served model's name.
    ModelName,
    /// Anything JSON, but only `null` or `[]` is accepted (`stop`).
    EmptyOrNull,
    /// An object of booleans (`return`).
    Flags,
    /// `/diff`'s `attribute`: a boolean, or `{layers: [first, last], pattern}` (the fake
    /// model's 2 layers and its modules).
    Attribute,
}

fn routes() -> Vec<Route> {
    let score_fields = vec![
        (
            "tokens",
            Kind::Ids {
                batch: true,
                empty_ok: false,
            },
        ),
        ("add_special_tokens", Kind::Bool),
        ("top_k", Kind::Int(0, 20)),
        ("return", Kind::Flags),
    ];
    let mut text_fields = score_fields.clone();
    text_fields[0] = (
        "text",
        Kind::Text {
            batch: true,
            empty_ok: true,
        },
    );
    vec![
        Route {
            path: "/score",
            base: json!({"tokens": [[5, 6, 7], [9, 8]], "top_k": 2}),
            fields: score_fields.clone(),
        },
        Route {
            path: "/v1/score",
            base: json!({"text": ["Hello world", "Hi"], "top_k": 1}),
            fields: text_fields,
        },
        Route {
            path: "/kld",
            base: json!({"tokens": [[5, 6, 7], [9, 8]], "per_token": true}),
            fields: vec![
                score_fields[0],
                ("add_special_tokens", Kind::Bool),
                ("per_token", Kind::Bool),
            ],
        },
        Route {
            path: "/diff",
            base: json!({"tokens": [[5, 6, 7], [9, 8]], "per_position": true,
                         "attribute": {"layers": [0, 1], "pattern": "*.mlp.*"}}),
            fields: vec![
                score_fields[0],
                ("add_special_tokens", Kind::Bool),
                ("per_position", Kind::Bool),
                ("reference_until", Kind::Int(0, 1)),
                ("attribute", Kind::Attribute),
            ],
        },
        Route {
            path: "/v1/completions",
            base: json!({"prompt": [[5, 7, 9]], "echo": true, "logprobs": 1, "max_tokens": 1,
                         "temperature": 0, "model": "fake", "seed": 1, "n": 1,
                         "stream": false, "user": "u", "add_special_tokens": false}),
            fields: vec![
                ("prompt", Kind::Prompt),
                ("model", Kind::ModelName),
                ("echo", Kind::Bool),
                ("logprobs", Kind::Int(0, 20)),
                ("max_tokens", Kind::Int(0, 1)),
                ("temperature", Kind::Zero),
                ("seed", Kind::AnyInt),
                ("n", Kind::Int(1, 1)),
                ("stream", Kind::Bool),
                ("stop", Kind::EmptyOrNull),
                ("user", Kind::Str),
                ("add_special_tokens", Kind::Bool),
            ],
        },
        Route {
            path: "/v1/completions",
            base: json!({"prompt": "Hello world", "max_tokens": 0, "logprobs": 0, "echo": true}),
            fields: vec![("prompt", Kind::Prompt)],
        },
        Route {
            path: "/tokenize",
            base: json!({"prompt": "Hello world", "add_special_tokens": true}),
            fields: vec![
                (
                    "prompt",
                    Kind::Text {
                        batch: false,
                        empty_ok: true,
                    },
                ),
                ("add_special_tokens", Kind::Bool),
            ],
        },
        Route {
            path: "/detokenize",
            base: json!({"tokens": [1992, 51, 78]}),
            fields: vec![(
                "tokens",
                Kind::Ids {
                    batch: false,
                    empty_ok: true,
                },
            )],
        },
    ]
}

/// Values of every JSON type, each wrong for some kinds.
fn generic_values() -> Vec<(&'static str, Value)> {
    vec![
        ("true", json!(true)),
        ("zero", json!(0)),
        ("negative", json!(-1)),
        ("int 2", json!(2)),
        ("int 21", json!(21)),
        ("float", json!(1.5)),
        ("i64::MIN", json!(i64::MIN)),
        ("u64::MAX", json!(u64::MAX)),
        ("string", json!("x")),
        ("numeric string", json!("3")),
        ("empty string", json!("")),
        ("empty list", json!([])),
        ("empty object", json!({})),
        ("object", json!({"a": 1})),
        ("list of null", json!([null])),
        ("list of bool", json!([true])),
        ("list of string", json!(["a"])),
        ("list of float", json!([1.5])),
        ("list of object", json!([{}])),
        ("nested list of float", json!([[1.5]])),
        ("long string", json!("x".repeat(100_000))),
        ("triple list", json!([[[1]]])),
    ]
}

/// Whether `v` is a value the field accepts (then it is not a bad-input case).
fn accepted(kind: Kind, v: &Value) -> bool {
    // `/detokenize` (`empty_ok`) has no length limit but the body's.
    let max_len = match kind {
        Kind::Ids { empty_ok: true, .. } => usize::MAX,
        _ => MAX_INPUT,
    };
    let ids_ok = |v: &Value| {
        v.as_array().is_some_and(|a| {
            !a.is_empty()
                && a.len() <= max_len
                && a.iter()
                    .all(|x| x.as_i64().is_some_and(|i| (0..VOCAB as i64).contains(&i)))
        })
    };
    match kind {
        Kind::Prompt => {
            accepted(
                Kind::Ids {
                    batch: true,
                    empty_ok: false,
                },
                v,
            ) || accepted(
                Kind::Text {
                    batch: true,
                    empty_ok: false,
                },
                v,
            )
        }
        Kind::Ids { batch, empty_ok } => {
            ids_ok(v)
                || (empty_ok && v.as_array().is_some_and(|a| a.is_empty()))
                || (batch
                    && v.as_array()
                        .is_some_and(|a| !a.is_empty() && a.len() <= 1024 && a.iter().all(ids_ok)))
        }
        // Scored text (`batch`) must have tokens and at most MAX_INPUT of them (32 bytes are
        // at most 34 tokens); `/tokenize` takes any string, the empty one included.
        Kind::Text { batch: false, .. } => v.is_string(),
        Kind::Text {
            batch: true,
            empty_ok,
        } => {
            let text_ok = |v: &Value| {
                v.as_str()
                    .is_some_and(|s| (empty_ok || !s.is_empty()) && s.len() <= 32)
            };
            text_ok(v)
                || v.as_array()
                    .is_some_and(|a| !a.is_empty() && a.len() <= 1024 && a.iter().all(text_ok))
        }
        Kind::Bool => v.is_boolean(),
        Kind::Int(lo, hi) => v.as_i64().is_some_and(|i| (lo..=hi).contains(&i)),
        Kind::AnyInt => v.is_i64(),
        Kind::Zero => v.as_f64() == Some(0.0),
        Kind::Str => v.is_string(),
        Kind::ModelName => v.as_str() == Some("fake"),
        Kind::EmptyOrNull => v.is_null() || v.as_array().is_some_and(|a| a.is_empty()),
        Kind::Flags => v.as_object().is_some_and(|o| o.is_empty()),
        // `{}` chooses every module.
        Kind::Attribute => v.is_boolean() || v.as_object().is_some_and(|o| o.is_empty()),
    }
}

/// Values specific to a kind: limits and malformed contents.
fn special_values(kind: Kind) -> Vec<(String, Value)> {
    let mut out: Vec<(String, Value)> = Vec::new();
    match kind {
        Kind::Prompt => {
            out.extend(special_values(Kind::Ids {
                batch: true,
                empty_ok: false,
            }));
            out.extend(special_values(Kind::Text {
                batch: true,
                empty_ok: false,
            }));
            out.push(("a text and ids".into(), json!(["a", [1, 2]])));
        }
        Kind::Ids { batch, empty_ok } => {
            for (label, id) in [
                ("id = vocab", json!(VOCAB)),
                ("id = -1", json!(-1)),
                ("id = 2^31", json!(1u64 << 31)),
                ("id = 2^32", json!(1u64 << 32)),
                ("id = i64::MAX", json!(i64::MAX)),
                ("id = 2^64-1", json!(u64::MAX)),
                ("id = 1e30", json!(1e30)),
                ("id = 1.0", json!(1.0)),
                ("id = \"1\"", json!("1")),
            ] {
                out.push((format!("{label} at [1]"), json!([1, id])));
                if batch {
                    out.push((format!("{label} at [1][0]"), json!([[1], [id]])));
                }
            }
            if !empty_ok {
                out.push(("10^6 tokens".into(), json!(vec![1; 1_000_000])));
                out.push((
                    format!("{} tokens (max_input_tokens + 1)", MAX_INPUT + 1),
                    json!(vec![1; MAX_INPUT + 1]),
                ));
            }
            if batch {
                out.push(("10^5 sequences".into(), json!(vec![vec![1, 2]; 100_000])));
                out.push(("1025 sequences".into(), json!(vec![vec![1, 2]; 1025])));
                out.push(("an empty sequence".into(), json!([[1, 2], []])));
                out.push(("ragged nesting".into(), json!([[1, 2], 3])));
            }
        }
        Kind::Text { batch, empty_ok } => {
            if batch {
                out.push(("10^5 texts".into(), json!(vec!["a"; 100_000])));
                if !empty_ok {
                    out.push(("an empty text".into(), json!(["a", ""])));
                }
                out.push(("a text and a number".into(), json!(["a", 1])));
                out.push(("10^6 tokens of text".into(), json!(" a".repeat(1_000_000))));
            }
        }
        Kind::Int(lo, hi) => {
            out.push(("below range".into(), json!(lo - 1)));
            out.push(("above range".into(), json!(hi + 1)));
            out.push(("i64::MAX".into(), json!(i64::MAX)));
            out.push(("1e300".into(), json!(1e300)));
        }
        Kind::Flags => {
            for flag in ["token_logprobs", "top_k", "greedy", "token_strings"] {
                out.push((format!("{flag}: 1"), json!({ flag: 1 })));
                out.push((format!("{flag}: \"yes\""), json!({ flag: "yes" })));
            }
            out.push(("unknown flag".into(), json!({"logits": true})));
        }
        Kind::Zero => {
            out.push(("0.5".into(), json!(0.5)));
            out.push(("-1e-300".into(), json!(-1e-300)));
        }
        Kind::Attribute => {
            for (label, value) in [
                ("layers reversed", json!({"layers": [1, 0]})),
                ("layers past the last", json!({"layers": [0, 2]})),
                ("one layer bound", json!({"layers": [0]})),
                ("negative layer", json!({"layers": [-1, 1]})),
                ("pattern matching nothing", json!({"pattern": "*.mlp.w1"})),
                ("pattern not a string", json!({"pattern": 1})),
                ("unknown member", json!({"layers": [0, 1], "modules": []})),
            ] {
                out.push((label.into(), value));
            }
        }
        Kind::ModelName => out.push(("other model".into(), json!("gpt-4"))),
        Kind::EmptyOrNull => out.push(("stop list".into(), json!(["\n"]))),
        Kind::Bool | Kind::AnyInt | Kind::Str => {}
    }
    out
}

/// `field` is required when the route has no valid body without it.
fn required(path: &str, field: &str) -> bool {
    matches!(
        (path, field),
        ("/score" | "/v1/score" | "/kld" | "/diff", "tokens" | "text")
            | ("/v1/completions", "prompt" | "max_tokens")
            | ("/tokenize", "prompt")
            | ("/detokenize", "tokens")
    )
}

fn cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for route in routes() {
        for &(field, kind) in &route.fields {
            let with = |value: Value| -> Vec<u8> {
                let mut body = route.base.clone();
                body[field] = value;
                body.to_string().into_bytes()
            };
            let name = |what: &str| format!("{} {field}: {what}", route.path);
            for (label, value) in generic_values() {
                if !accepted(kind, &value) {
                    cases.push(Case::json(name(label), route.path, with(value), field));
                }
            }
            for (label, value) in special_values(kind) {
                assert!(!accepted(kind, &value), "{}", name(&label));
                cases.push(Case::json(name(&label), route.path, with(value), field));
            }
            if required(route.path, field) {
                // `/score` without either input names `tokens` (rule `required_one_of`; the
                // message names both).
                let missing = if field == "text" { "tokens" } else { field };
                let mut body = route.base.clone();
                body.as_object_mut().unwrap().remove(field);
                cases.push(Case::json(
                    name("missing"),
                    route.path,
                    body.to_string().into_bytes(),
                    missing,
                ));
                cases.push(Case::json(
                    name("null"),
                    route.path,
                    with(Value::Null),
                    missing,
                ));
            }
            // Invalid UTF-8 inside the field's value (a string where one is expected, else a
            // string in place of the value).
            let mut body = route.base.clone();
            body[field] = json!("@@");
            let bytes = body
                .to_string()
                .replace("\"@@\"", "\"\u{1}\u{1}\"")
                .into_bytes();
            let bytes = replace_bytes(&bytes, &[1, 1], &[0xff, 0xfe]);
            cases.push(Case::json(name("invalid UTF-8"), route.path, bytes, field));
            // Deep nesting inside the field.
            let deep = format!("{}1{}", "[".repeat(100_000), "]".repeat(100_000));
            let body = with(json!("@@"));
            let body = String::from_utf8(body).unwrap().replace("\"@@\"", &deep);
            cases.push(Case::json(
                name("10^5 nested lists"),
                route.path,
                body.into_bytes(),
                field,
            ));
            // The same key twice (the second value valid): refused, not last-wins.
            let mut body = route.base.clone();
            let original = body[field].clone();
            body.as_object_mut().unwrap().remove(field);
            let text = body.to_string();
            let dup = format!(
                "{{\"{field}\": {original}, \"{field}\": {original}, {}",
                &text[1..]
            );
            cases.push(Case::json(
                name("duplicate key"),
                route.path,
                dup.into_bytes(),
                field,
            ));
        }
        // Whole-body cases: the error names `body` or the member where parsing stopped.
        let base = route.base.to_string();
        let mut unknown = route.base.clone();
        unknown["bogus"] = json!(1);
        let whole: Vec<(&str, Vec<u8>, &'static str)> = vec![
            ("empty body", Vec::new(), "body"),
            ("null body", b"null".to_vec(), "body"),
            ("list body", b"[]".to_vec(), "body"),
            ("string body", b"\"x\"".to_vec(), "body"),
            ("number body", b"1".to_vec(), "body"),
            ("NaN body", b"NaN".to_vec(), "body"),
            ("truncated", base.as_bytes()[..base.len() - 1].to_vec(), ""),
            ("trailing garbage", format!("{base} x").into_bytes(), "body"),
            (
                "two documents",
                format!("{base}{base}").into_bytes(),
                "body",
            ),
            ("unknown field", unknown.to_string().into_bytes(), "bogus"),
            ("single quotes", base.replace('"', "'").into_bytes(), "body"),
            (
                "10^5 nested lists",
                format!("{}{}", "[".repeat(100_000), "]".repeat(100_000)).into_bytes(),
                "",
            ),
            (
                "10^5 nested objects",
                format!("{}{}", "{\"a\":".repeat(100_000), "}".repeat(100_000)).into_bytes(),
                "",
            ),
            ("invalid UTF-8 key", b"{\"\xff\": 1}".to_vec(), ""),
            (
                "UTF-8 BOM",
                [&b"\xef\xbb\xbf"[..], base.as_bytes()].concat(),
                "body",
            ),
        ];
        for (label, body, field) in whole {
            // The tokenizer routes take vLLM's request shapes, whose extra members (`model`,
            // `return_token_strs`, ...) clients send: unknown members are ignored there.
            if label == "unknown field" && route.path.contains("tokenize") {
                continue;
            }
            cases.push(Case::json(
                format!("{} {label}", route.path),
                route.path,
                body,
                field,
            ));
        }
        cases.push(Case::json(
            format!("{} invalid UTF-8 bytes outside strings", route.path),
            route.path,
            vec![0xff, 0xfe, b'{', b'}'],
            "body",
        ));
        for ct in [
            "text/plain",
            "text/html; charset=utf-8",
            "multipart/form-data; boundary=x",
            "application/xml",
            "application/octet-stream",
            "image/png",
        ] {
            cases.push(Case {
                label: format!("{} content-type {ct}", route.path),
                method: Method::POST,
                path: route.path,
                content_type: Some(ct),
                body: base.clone().into_bytes(),
                field: "content-type",
            });
        }
    }
    // Wrong methods on every route.
    let routes: [(&'static str, Method); 15] = [
        ("/score", Method::POST),
        ("/kld", Method::POST),
        ("/diff", Method::POST),
        ("/v1/score", Method::POST),
        ("/v1/completions", Method::POST),
        ("/tokenize", Method::POST),
        ("/detokenize", Method::POST),
        ("/tokenizer_info", Method::GET),
        ("/tokenizer.json", Method::GET),
        ("/v1/models", Method::GET),
        ("/info", Method::GET),
        ("/health/live", Method::GET),
        ("/health/ready", Method::GET),
        ("/metrics", Method::GET),
        ("/openapi.json", Method::GET),
    ];
    for (path, allowed) in routes {
        for method in [
            Method::GET,
            Method::POST,
            Method::PUT,
            Method::DELETE,
            Method::PATCH,
        ] {
            if method != allowed {
                cases.push(Case {
                    label: format!("{method} {path}"),
                    method,
                    path,
                    content_type: None,
                    body: Vec::new(),
                    field: "method",
                });
            }
        }
    }
    cases
}

fn replace_bytes(haystack: &[u8], from: &[u8], to: &[u8]) -> Vec<u8> {
    let at = haystack
        .windows(from.len())
        .position(|w| w == from)
        .expect("marker present");
    [&haystack[..at], to, &haystack[at + from.len()..]].concat()
}

/// `expected` empty: any field will do (body-level syntax errors name where parsing stopped).
fn names(field: &str, expected: &str) -> bool {
    (expected.is_empty() && !field.is_empty())
        || field == expected
        || field
            .strip_prefix(expected)
            .is_some_and(|rest| rest.starts_with('[') || rest.starts_with('.'))
}

/// What a valid request answers; compared byte for byte after every bad case.
async fn probe(app: &Router, key: Option<&str>) -> Vec<u8> {
    let case = Case::json(
        "probe",
        "/score",
        json!({"tokens": [[5, 6, 7], [9, 8]], "top_k": 2, "return": {"greedy": true}})
            .to_string()
            .into_bytes(),
        "",
    );
    let (status, _, body) = send(app, case.request(key)).await;
    assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
    let mut v: Value = serde_json::from_slice(&body).unwrap();
    v.as_object_mut().unwrap().remove("usage"); // timings
    v.to_string().into_bytes()
}

/// Every generated case: 4xx, a JSON error body naming the field, and a healthy server that
/// answers the next valid request exactly as the first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_bad_input_gets_a_4xx_naming_the_field() {
    let start = Instant::now();
    let key = Some("k3y");
    let app = app(key, false, BIG_BODY).await;
    let expected = probe(&app, key).await;
    let cases = cases();
    let mut by_status: BTreeMap<u16, usize> = BTreeMap::new();
    for (i, case) in cases.iter().enumerate() {
        let (status, headers, body) = send(&app, case.request(key)).await;
        let text = String::from_utf8_lossy(&body[..body.len().min(400)]).into_owned();
        assert!(
            status.is_client_error(),
            "case {i} `{}`: status {status}: {text}",
            case.label
        );
        assert_eq!(
            headers
                .get(header::CONTENT_TYPE)
                .map(|v| v.to_str().unwrap()),
            Some("application/json"),
            "case `{}`",
            case.label
        );
        let e: ErrorBody = serde_json::from_slice(&body).unwrap_or_else(|err| {
            panic!("case `{}`: not an ErrorBody ({err}): {text}", case.label)
        });
        let field = e.field.clone().unwrap_or_default();
        assert!(
            names(&field, case.field),
            "case `{}`: field `{field}`, expected `{}`: {text}",
            case.label,
            case.field
        );
        assert!(
            body.len() < 2048,
            "case `{}`: error echoes {} bytes",
            case.label,
            body.len()
        );
        *by_status.entry(status.as_u16()).or_default() += 1;
        // Still healthy, still exact. (Every case on the cheap ones; the probe is ~1 ms.)
        let (ready, _, _) = send(
            &app,
            Request::get("/health/ready").body(Body::empty()).unwrap(),
        )
        .await;
        assert_eq!(ready, StatusCode::OK, "after `{}`", case.label);
        assert_eq!(probe(&app, key).await, expected, "after `{}`", case.label);
    }
    println!(
        "bad-input cases: {} ({by_status:?}), {:.1} s",
        cases.len(),
        start.elapsed().as_secs_f64()
    );
    // The generated count: a change to the generator or the routes must update it (and
    // docs/reliability.md).
    assert_eq!(cases.len(), BAD_INPUT_CASES, "{by_status:?}");
}

const BAD_INPUT_CASES: usize = 1199;

/// A body over the limit is a 413 naming `body`, and the server carries on.
#[tokio::test]
async fn over_the_body_limit_is_413_naming_body() {
    let app = app(None, false, 64 * 1024).await;
    let expected = probe(&app, None).await;
    for path in [
        "/score",
        "/v1/score",
        "/v1/completions",
        "/tokenize",
        "/detokenize",
    ] {
        let body = json!({"tokens": vec![1; 1_000_000]})
            .to_string()
            .into_bytes();
        let case = Case::json("huge", path, body, "body");
        let (status, _, body) = send(&app, case.request(None)).await;
        assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{path}");
        let e: ErrorBody = serde_json::from_slice(&body).unwrap();
        assert_eq!(e.field.as_deref(), Some("body"));
        assert_eq!(probe(&app, None).await, expected);
    }
}

// ---- API key ---------------------------------------------------------------------------

const KEY: &str = "correct-horse-battery-staple";

fn get(path: &str, key: Option<&str>) -> Request<Body> {
    let mut b = Request::get(path);
    if let Some(key) = key {
        b = b.header(header::AUTHORIZATION, format!("Bearer {key}"));
    }
    b.body(Body::empty()).unwrap()
}

fn post(path: &str, key: Option<&str>, body: &Value) -> Request<Body> {
    let mut b = Request::post(path).header(header::CONTENT_TYPE, "application/json");
    if let Some(key) = key {
        b = b.header(header::AUTHORIZATION, format!("Bearer {key}"));
    }
    b.body(Body::from(body.to_string())).unwrap()
}

/// Every route of the OpenAPI document but the probes is 401 without the key, 401 with a
/// wrong one (same length, one byte off, a prefix, the key plus a byte, other schemes), and
/// not 401 with it.
#[tokio::test]
async fn every_route_but_health_needs_the_key() {
    let app = app(Some(KEY), false, BIG_BODY).await;
    let doc = exactscore_server::http::openapi();
    let mut checked = 0;
    let mut paths: Vec<(String, bool)> = doc
        .paths
        .paths
        .iter()
        .map(|(p, item)| (p.clone(), item.post.is_some()))
        .collect();
    paths.push(("/openapi.json".into(), false));
    let mut wrong: Vec<String> = vec![
        String::new(),
        format!("Bearer {}", &KEY[..KEY.len() - 1]),
        format!("Bearer {KEY}x"),
        format!("Bearer {}X", &KEY[..KEY.len() - 1]),
        format!("bearer{KEY}"),
        format!("Basic {KEY}"),
        format!("Bearer  {KEY}"),
        KEY.to_string(),
        "Bearer ".into(),
    ];
    wrong.push(format!("Bearer {}", KEY.to_uppercase()));
    for (path, is_post) in &paths {
        let open = path.starts_with("/health/");
        let body = json!({"tokens": [1, 2], "prompt": "x"});
        let req = |auth: Option<&str>| {
            let mut r = if *is_post {
                post(path, None, &body)
            } else {
                get(path, None)
            };
            if let Some(a) = auth {
                r.headers_mut()
                    .insert(header::AUTHORIZATION, a.parse().unwrap());
            }
            r
        };
        for w in &wrong {
            let auth = (!w.is_empty()).then_some(w.as_str());
            let (status, _, body) = send(&app, req(auth)).await;
            if open {
                assert_eq!(status, StatusCode::OK, "{path}");
            } else {
                assert_eq!(status, StatusCode::UNAUTHORIZED, "{path} with `{w}`");
                let e: ErrorBody = serde_json::from_slice(&body).unwrap();
                assert_eq!(e.kind, "unauthorized");
                assert!(!String::from_utf8_lossy(&body).contains(KEY));
            }
            checked += 1;
        }
        let right = format!("Bearer {KEY}");
        let (status, _, _) = send(&app, req(Some(&right))).await;
        assert_ne!(status, StatusCode::UNAUTHORIZED, "{path} with the key");
        // 200, or a 4xx about the body or the server's set-up (e.g. no reference model).
        assert!(!status.is_server_error(), "{path}: {status}");
        checked += 1;
    }
    println!("auth checks: {checked} over {} routes", paths.len());
    assert!(paths.len() >= 13, "{paths:?}");
}

/// Spellings of a protected path never reach a handler without the key: 401, and with the key
/// they are 404 (no route) or the route itself, never served open.
#[tokio::test]
async fn path_variants_cannot_bypass_the_key() {
    let app = app(Some(KEY), false, BIG_BODY).await;
    let variants = [
        "/score/",
        "//score",
        "/%73core",
        "/%73%63%6f%72%65",
        "/SCORE",
        "/Score",
        "/score%2F",
        "/./score",
        "/v1/../score",
        "/health/../score",
        "/health/live/../../score",
        "/health/%2e%2e/score",
        "/health/live/",
        "/health//live",
        "//health/live",
        "/health/live?x=/score",
        "/health/live%00",
        "/metrics/",
        "/%6detrics",
        "/info;x",
        "/score?",
        "/v1//score",
        "/v1/%73core",
    ];
    let body = json!({"tokens": [1, 2]});
    for path in variants {
        let (status, _, text) = send(&app, post(path, None, &body)).await;
        let open_probe = path.starts_with("/health/live?");
        if open_probe {
            // The query is not part of the path: this is `/health/live` (GET only) itself.
            assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED, "{path}");
            continue;
        }
        assert_eq!(
            status,
            StatusCode::UNAUTHORIZED,
            "POST {path} without key: {}",
            String::from_utf8_lossy(&text)
        );
        let (status, _, _) = send(&app, get(path, None)).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "GET {path} without key");
        let (status, _, _) = send(&app, post(path, Some(KEY), &body)).await;
        assert!(
            [
                StatusCode::NOT_FOUND,
                StatusCode::OK,
                StatusCode::METHOD_NOT_ALLOWED
            ]
            .contains(&status),
            "POST {path} with key: {status}"
        );
    }
}

/// `/metrics` needs the key unless `--metrics-without-auth`; the flag opens nothing else.
#[tokio::test]
async fn metrics_without_auth_opens_only_metrics() {
    let closed = app(Some(KEY), false, BIG_BODY).await;
    assert_eq!(
        send(&closed, get("/metrics", None)).await.0,
        StatusCode::UNAUTHORIZED
    );
    let open = app(Some(KEY), true, BIG_BODY).await;
    let (status, _, body) = send(&open, get("/metrics", None)).await;
    assert_eq!(status, StatusCode::OK);
    assert!(String::from_utf8_lossy(&body).contains("exactscore_"));
    for path in [
        "/metrics/",
        "//metrics",
        "/METRICS",
        "/info",
        "/openapi.json",
        "/v1/models",
    ] {
        assert_eq!(
            send(&open, get(path, None)).await.0,
            StatusCode::UNAUTHORIZED,
            "{path}"
        );
    }
    assert_eq!(
        send(&open, post("/score", None, &json!({"tokens": [1, 2]})))
            .await
            .0,
        StatusCode::UNAUTHORIZED
    );
}
