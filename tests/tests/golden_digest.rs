//! The refactoring guard: the sha256 of every `/score`, `/kld` and `/diff` response on every
//! fixture, in f32 and bf16 on the CPU, equals the digest recorded in `tests/golden/digests.json`.
//!
//! A change that moves any bit of any answer fails here. When a change of numbers is intended,
//! record the new digests and say why in the commit:
//!     EXACTSCORE_UPDATE_GOLDEN=1 cargo test -p exactscore-tests --test golden_digest
//! The timing fields of `usage` (`queue_ms`, `compute_ms`) are left out of the digest; every
//! other byte of the response body counts.

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;

use common::{fixture, reference_sequences, start};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

/// Pairs of fixture names and what goes with them.
type Pairs = Vec<(String, String)>;

/// tests/golden/cases.json: the cases, the layouts and the requests.
fn table() -> &'static Value {
    static TABLE: std::sync::OnceLock<Value> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("golden/cases.json");
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    })
}

/// (served, reference) pairs and (served, device layout) pairs of the table.
fn cases() -> (Pairs, Pairs) {
    let v = table();
    let pairs = |key: &str, second: &str| -> Pairs {
        v[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| {
                (
                    c["served"].as_str().unwrap().into(),
                    c[second].as_str().unwrap().into(),
                )
            })
            .collect()
    };
    (pairs("cases", "reference"), pairs("layouts", "device"))
}

fn golden_file() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("golden/digests.json")
}

/// The requests of tests/golden/cases.json for one fixture: (name, route, body), `tokens`
/// (and `attribute`, where asked) filled in.
fn requests(seqs: &[Vec<u32>], attribute: bool) -> Vec<(String, String, Value)> {
    table()["requests"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let mut body = r["body"].clone();
            let n = r["sequences"].as_u64().map_or(seqs.len(), |n| n as usize);
            body["tokens"] = json!(seqs[..n]);
            if r["attribute"].as_bool() == Some(true) {
                body["attribute"] = json!(attribute);
            }
            let text = |key: &str| r[key].as_str().unwrap().to_string();
            (text("name"), text("route"), body)
        })
        .collect()
}

fn without_timings(mut v: Value) -> Value {
    fn walk(v: &mut Value) {
        match v {
            Value::Object(map) => {
                map.remove("queue_ms");
                map.remove("compute_ms");
                map.values_mut().for_each(walk);
            }
            Value::Array(items) => items.iter_mut().for_each(walk),
            _ => {}
        }
    }
    walk(&mut v);
    v
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The digests of one server configuration, keyed `variant/dtype/device/route`.
async fn digests_of(
    variant: &str,
    reference: &str,
    dtype: &str,
    device: &str,
) -> Vec<(String, String)> {
    let reference_dir = fixture(reference);
    let server = start(
        variant,
        &[
            "--dtype",
            dtype,
            "--device",
            device,
            "--reference-model",
            reference_dir.to_str().unwrap(),
        ],
    )
    .await;
    let client = reqwest::Client::new();
    let mut out = Vec::new();
    for (name, route, body) in requests(&reference_sequences(variant), variant != reference) {
        let res = client
            .post(format!("{}/{route}", server.base))
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = res.status().as_u16();
        let text = res.text().await.unwrap();
        assert_eq!(status, 200, "{variant} {dtype} {device} /{route}: {text}");
        let canonical =
            serde_json::to_vec(&without_timings(serde_json::from_str(&text).unwrap())).unwrap();
        out.push((
            format!("{variant}/{dtype}/{device}/{name}"),
            sha256_hex(&canonical),
        ));
    }
    let _ = server.stop.send(());
    server.done.await.unwrap().unwrap();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_response_on_every_fixture_equals_the_recorded_digest() {
    let (served_cases, layouts) = cases();
    let mut now = BTreeMap::new();
    for (variant, reference) in &served_cases {
        for dtype in ["f32", "bf16"] {
            now.extend(digests_of(variant, reference, dtype, "cpu").await);
        }
    }
    for (variant, device) in &layouts {
        let reference = &served_cases.iter().find(|c| &c.0 == variant).unwrap().1;
        now.extend(digests_of(variant, reference, "f32", device).await);
    }

    if std::env::var_os("EXACTSCORE_UPDATE_GOLDEN").is_some() {
        let text = serde_json::to_string_pretty(&now).unwrap() + "\n";
        std::fs::create_dir_all(golden_file().parent().unwrap()).unwrap();
        std::fs::write(golden_file(), text).unwrap();
        println!(
            "recorded {} digests in {}",
            now.len(),
            golden_file().display()
        );
        return;
    }
    let recorded: BTreeMap<String, String> =
        serde_json::from_str(&std::fs::read_to_string(golden_file()).unwrap()).unwrap();
    let differing: Vec<&String> = recorded
        .keys()
        .chain(now.keys())
        .filter(|k| recorded.get(*k) != now.get(*k))
        .collect();
    assert!(
        differing.is_empty(),
        "{} of {} responses differ from tests/golden/digests.json: {differing:?}\n\
         If the change of numbers is intended, record them with\n    \
         EXACTSCORE_UPDATE_GOLDEN=1 cargo test -p exactscore-tests --test golden_digest",
        differing.len(),
        recorded.len()
    );
    println!("{} digests equal", now.len());
}
