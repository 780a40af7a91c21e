//! End to end: the real server on 127.0.0.1:0 with a fixture model (f32, CPU), over TCP.
//! Scores must equal reference.json (≤ 1e-4 per token) for token and text input, single,
//! batched and concurrent.

use std::time::Instant;

use exactscore_api::ScoreResponse;
use serde_json::{json, Value};

mod common;

use common::{fixture, start};

const TOLERANCE: f64 = 1e-4;

struct Reference {
    texts: Vec<String>,
    ids: Vec<Vec<u32>>,
    logprobs: Vec<Vec<Option<f64>>>,
}

fn reference(variant: &str) -> Reference {
    let text = std::fs::read_to_string(fixture(variant).join("reference.json")).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    let seqs = v["sequences"].as_array().unwrap();
    Reference {
        texts: seqs
            .iter()
            .map(|s| s["text"].as_str().unwrap().to_string())
            .collect(),
        ids: seqs
            .iter()
            .map(|s| serde_json::from_value(s["token_ids"].clone()).unwrap())
            .collect(),
        logprobs: seqs
            .iter()
            .map(|s| serde_json::from_value(s["token_logprobs"].clone()).unwrap())
            .collect(),
    }
}

async fn score(client: &reqwest::Client, base: &str, body: Value) -> ScoreResponse {
    let res = client
        .post(format!("{base}/score"))
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = res.status();
    let text = res.text().await.unwrap();
    assert_eq!(status, 200, "{text}");
    serde_json::from_str(&text).unwrap()
}

fn check(r: &ScoreResponse, reference: &Reference, which: &[usize]) {
    assert_eq!(r.sequences.len(), which.len());
    for (seq, &i) in r.sequences.iter().zip(which) {
        assert_eq!(seq.tokens, reference.ids[i], "sequence {i}: token ids");
        let got = seq.token_logprobs.as_ref().unwrap();
        assert_eq!(got.len(), reference.logprobs[i].len());
        assert_eq!(got[0], None, "first token has no logprob");
        for (pos, (g, want)) in got.iter().zip(&reference.logprobs[i]).enumerate().skip(1) {
            let (g, want) = (g.unwrap() as f64, want.unwrap());
            assert!(
                (g - want).abs() <= TOLERANCE,
                "sequence {i} position {pos}: got {g}, reference {want}"
            );
        }
        assert_eq!(seq.num_scored, reference.ids[i].len() - 1);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_server_matches_reference_logprobs() {
    let variant = "llama-w4a16-g128";
    let reference = reference(variant);
    let server = start(variant, &[]).await;
    let client = reqwest::Client::new();
    let base = server.base.as_str();
    let n = reference.ids.len();
    let all: Vec<usize> = (0..n).collect();

    // Token input, one sequence per request.
    for i in 0..n {
        let r = score(&client, base, json!({ "tokens": reference.ids[i] })).await;
        check(&r, &reference, &[i]);
    }
    // Text input: the server's tokenizer must give exactly the reference ids.
    for i in 0..n {
        let r = score(&client, base, json!({ "text": reference.texts[i] })).await;
        check(&r, &reference, &[i]);
    }
    // Batched, token and text.
    let r = score(&client, base, json!({ "tokens": reference.ids })).await;
    check(&r, &reference, &all);
    let r = score(
        &client,
        base,
        json!({ "text": reference.texts, "top_k": 3 }),
    )
    .await;
    check(&r, &reference, &all);

    // Concurrent: 8 requests at once, each gets its own answer.
    let tasks: Vec<_> = (0..8)
        .map(|k| {
            let (client, base) = (client.clone(), server.base.clone());
            let order: Vec<usize> = (0..n).map(|j| (j + k) % n).take(1 + k % n).collect();
            let ids: Vec<Vec<u32>> = order.iter().map(|&i| reference.ids[i].clone()).collect();
            tokio::spawn(
                async move { (order, score(&client, &base, json!({ "tokens": ids })).await) },
            )
        })
        .collect();
    for t in tasks {
        let (order, r) = t.await.unwrap();
        check(&r, &reference, &order);
    }

    // Latency of the longest (256-token) reference sequence, reported, not asserted.
    let longest = (0..n).max_by_key(|&i| reference.ids[i].len()).unwrap();
    let start = Instant::now();
    let r = score(&client, base, json!({ "tokens": reference.ids[longest] })).await;
    eprintln!(
        "e2e latency, {} tokens f32 CPU: {:.1} ms (compute {:.1} ms, queue {:.1} ms)",
        reference.ids[longest].len(),
        start.elapsed().as_secs_f64() * 1e3,
        r.usage.compute_ms,
        r.usage.queue_ms
    );

    // Graceful shutdown: readiness is dropped, then serve returns cleanly.
    server.stop.send(()).unwrap();
    server.done.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_variant_batched_matches_reference() {
    let variant = "llama-w8a16-channel";
    let reference = reference(variant);
    let server = start(variant, &[]).await;
    let client = reqwest::Client::new();
    let r = score(&client, &server.base, json!({ "text": reference.texts })).await;
    let all: Vec<usize> = (0..reference.ids.len()).collect();
    check(&r, &reference, &all);
    server.stop.send(()).unwrap();
    server.done.await.unwrap().unwrap();
}
