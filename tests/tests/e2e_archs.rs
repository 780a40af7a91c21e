//! End to end on the real server (f32, CPU): Qwen3-MoE, Mixtral, Gemma 3, Gemma 2, Gemma 4,
//! Qwen3.5-MoE, Qwen3-Next and gpt-oss (native MXFP4) fixtures through `/score` and
//! `/v1/completions` against the transformers references, and `/kld` with Gemma 3's dense bf16
//! checkpoint as the reference of its W4A16.

use exactscore_api::{CompletionResponse, KldResponse, ScoreResponse};
use exactscore_server::model::kld_batch;
use serde_json::{json, Value};

mod common;

use common::{fixture, load_model, post_ok, start};

const TOLERANCE: f64 = 1e-4;

/// (text, token ids, reference log-probs) of every reference sequence.
fn reference(variant: &str) -> Vec<(String, Vec<u32>, Vec<Option<f64>>)> {
    let text = std::fs::read_to_string(fixture(variant).join("reference.json")).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    v["sequences"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["text"].as_str().unwrap().to_string(),
                serde_json::from_value(s["token_ids"].clone()).unwrap(),
                serde_json::from_value(s["token_logprobs"].clone()).unwrap(),
            )
        })
        .collect()
}

fn assert_close(variant: &str, got: &[Option<f32>], want: &[Option<f64>]) {
    assert_eq!(got.len(), want.len());
    assert!(got[0].is_none());
    for (pos, (g, w)) in got.iter().zip(want).enumerate().skip(1) {
        let (g, w) = (g.unwrap() as f64, w.unwrap());
        assert!(
            (g - w).abs() <= TOLERANCE,
            "{variant} position {pos}: {g} vs reference {w}"
        );
    }
}

async fn score_and_complete(variant: &str) {
    let server = start(variant, &[]).await;
    let sequences = reference(variant);
    let ids: Vec<&Vec<u32>> = sequences.iter().map(|(_, ids, _)| ids).collect();
    let r: ScoreResponse =
        serde_json::from_str(&post_ok(&server.base, "/score", json!({ "tokens": ids })).await)
            .unwrap();
    for (seq, (_, ids, want)) in r.sequences.iter().zip(&sequences) {
        assert_eq!(&seq.tokens, ids);
        assert_close(variant, seq.token_logprobs.as_ref().unwrap(), want);
    }
    // The longest text (256 tokens, past Gemma's 32-token window) as an echoed prompt.
    let (text, ids, want) = &sequences[3];
    let body = json!({"prompt": text, "echo": true, "logprobs": 1, "max_tokens": 0,
                      "add_special_tokens": true});
    let c: CompletionResponse =
        serde_json::from_str(&post_ok(&server.base, "/v1/completions", body).await).unwrap();
    let lp = c.choices[0].logprobs.as_ref().unwrap();
    assert_eq!(c.usage.prompt_tokens, ids.len());
    assert_close(variant, &lp.token_logprobs, want);
    let _ = server.stop.send(());
    server.done.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qwen3_moe_over_http_matches_reference() {
    score_and_complete("qwen3moe-w4a16-g32").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixtral_over_http_matches_reference() {
    score_and_complete("mixtral-w4a16-g32").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gemma2_over_http_matches_reference() {
    score_and_complete("gemma2-w4a16-g32").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gemma3_over_http_matches_reference() {
    score_and_complete("gemma3-w4a16-g32").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gemma4_over_http_matches_reference() {
    score_and_complete("gemma4-w4a16-g32").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gemma4_moe_over_http_matches_reference() {
    score_and_complete("gemma4_moe-w4a16-g32").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qwen3_5_moe_over_http_matches_reference() {
    score_and_complete("qwen3_5_moe-w4a16-g32").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qwen3_next_over_http_matches_reference() {
    score_and_complete("qwen3_next-w4a16-g32").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gemma3_kld_against_its_dense_original() {
    const SERVED: &str = "gemma3-w4a16-g32";
    const REFERENCE: &str = "gemma3-dense-bf16";
    let reference_dir = fixture(REFERENCE);
    let server = start(
        SERVED,
        &["--reference-model", reference_dir.to_str().unwrap()],
    )
    .await;
    let seqs: Vec<Vec<u32>> = reference(REFERENCE).into_iter().map(|s| s.1).collect();
    let r: KldResponse =
        serde_json::from_str(&post_ok(&server.base, "/kld", json!({ "tokens": seqs })).await)
            .unwrap();
    let refs: Vec<&[u32]> = seqs.iter().map(Vec::as_slice).collect();
    let direct = kld_batch(&load_model(SERVED), &load_model(REFERENCE), &refs).unwrap();
    let served = reference(SERVED);
    let dense = reference(REFERENCE);
    for (i, (seq, d)) in r.sequences.iter().zip(&direct).enumerate() {
        let kld = seq.kld.as_ref().unwrap();
        for (j, t) in d.tokens.iter().enumerate() {
            assert_eq!(kld[j + 1], Some(t.kld));
            assert!(t.kld >= 0.0);
        }
        // each side's log-probs are the transformers references of the two checkpoints
        assert_close(SERVED, seq.logprobs.as_ref().unwrap(), &served[i].2);
        assert_close(
            REFERENCE,
            seq.reference_logprobs.as_ref().unwrap(),
            &dense[i].2,
        );
        assert!(seq.sum_kld > 0.0, "W4A16 equals its dense original?");
    }
    let _ = server.stop.send(());
    server.done.await.unwrap().unwrap();
}

/// gpt-oss with its experts in the native MXFP4 layout: `/info` names the format and the
/// materialized attention (sinks), and the scores are transformers'.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpt_oss_mxfp4_over_http_matches_reference() {
    let variant = "gpt_oss-mxfp4";
    let server = start(variant, &[]).await;
    let info: Value = reqwest::get(format!("{}/info", server.base))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(info["architecture"], "GptOssForCausalLM", "{info}");
    assert_eq!(info["attention"], "materialized", "{info}");
    let formats = info["formats"].to_string();
    assert!(
        formats.contains("mxfp4 fp4 e2m1 g32 (ue8m0 scales)"),
        "{info}"
    );
    let _ = server.stop.send(());
    server.done.await.unwrap().unwrap();
    score_and_complete(variant).await;
}
