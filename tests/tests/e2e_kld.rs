//! End to end: `POST /kld` on the real server (f32, CPU) with the W4A16 fixture served and its
//! dense bf16 original as the reference: the HTTP numbers equal the model-level computation,
//! which `server/tests/kld_numerics.rs` checks against an independent f64 one.

use clap::Parser;
use exactscore_api::{ErrorBody, KldResponse};
use exactscore_server::app::Server;
use exactscore_server::config::{Args, Config};
use exactscore_server::model::kld_batch;
use serde_json::{json, Value};

mod common;

use common::{fixture, load_model, post, start};

const SERVED: &str = "llama-w4a16-g128";
const REFERENCE: &str = "llama-dense-bf16";

fn fixture_sequences() -> Vec<Vec<u32>> {
    common::reference_sequences(REFERENCE)
}

#[tokio::test]
async fn kld_over_http_equals_the_model_computation() {
    let reference_dir = fixture(REFERENCE);
    let server = start(
        SERVED,
        &["--reference-model", reference_dir.to_str().unwrap()],
    )
    .await;
    let seqs = fixture_sequences();
    let (status, text) = post(&server.base, "/kld", json!({ "tokens": seqs })).await;
    assert_eq!(status, 200, "{text}");
    let r: KldResponse = serde_json::from_str(&text).unwrap();
    assert_eq!(
        (r.model.as_str(), r.reference_model.as_str()),
        (SERVED, REFERENCE)
    );

    let refs: Vec<&[u32]> = seqs.iter().map(Vec::as_slice).collect();
    let direct = kld_batch(&load_model(SERVED), &load_model(REFERENCE), &refs).unwrap();
    let mut scored = 0;
    for ((seq, d), tokens) in r.sequences.iter().zip(&direct).zip(&seqs) {
        assert_eq!(&seq.tokens, tokens);
        let (kld, lp, rlp) = (
            seq.kld.as_ref().unwrap(),
            seq.logprobs.as_ref().unwrap(),
            seq.reference_logprobs.as_ref().unwrap(),
        );
        let (same, dp) = (
            seq.same_top.as_ref().unwrap(),
            seq.delta_p.as_ref().unwrap(),
        );
        assert_eq!(kld.len(), tokens.len());
        assert!(kld[0].is_none() && lp[0].is_none() && same[0].is_none() && dp[0].is_none());
        for (i, t) in d.tokens.iter().enumerate() {
            assert_eq!(kld[i + 1], Some(t.kld), "position {}", i + 1);
            assert_eq!(lp[i + 1], Some(t.logprob));
            assert_eq!(rlp[i + 1], Some(t.reference_logprob));
            assert_eq!(same[i + 1], Some(t.same_top));
            let expect = (t.logprob as f64).exp() - (t.reference_logprob as f64).exp();
            assert_eq!(dp[i + 1], Some(expect));
            assert_eq!(
                seq.reverse_kld.as_ref().unwrap()[i + 1],
                Some(t.reverse_kld)
            );
            assert_eq!(
                seq.top_k_agreement.as_ref().unwrap()[i + 1],
                Some(t.top_k_agreement)
            );
            assert_eq!(
                seq.reference_top_p.as_ref().unwrap()[i + 1],
                Some(t.reference_top_p)
            );
        }
        assert!((seq.sum_reverse_kld - d.sum_reverse_kld()).abs() <= 1e-12);
        assert_eq!(seq.top_k_agreement_counts, d.top_k_agreement_counts());
        assert_eq!(seq.top_k_agreement_counts[0], seq.same_top_count);
        // The buckets partition the positions and their divergences.
        let buckets = &seq.confidence_buckets;
        assert_eq!(buckets.len(), exactscore_api::CONFIDENCE_BUCKETS.len());
        assert_eq!(
            buckets.iter().map(|b| b.count).sum::<usize>(),
            seq.num_scored
        );
        let bucketed: f64 = buckets.iter().map(|b| b.sum_kld).sum();
        assert!((bucketed - seq.sum_kld).abs() <= 1e-12 * seq.sum_kld.max(1.0));
        for (b, (lower, upper)) in buckets.iter().zip(exactscore_api::CONFIDENCE_BUCKETS) {
            let inside = d.tokens.iter().filter(|t| {
                t.reference_top_p >= lower && (t.reference_top_p < upper || upper == 1.0)
            });
            assert_eq!(b.count, inside.count(), "bucket [{lower}, {upper})");
        }
        assert_eq!(seq.num_scored, tokens.len() - 1);
        assert!((seq.sum_kld - d.sum_kld()).abs() <= 1e-12 * d.sum_kld().max(1.0));
        assert_eq!(seq.same_top_count, d.same_top_count());
        assert!((seq.sum_nll - d.sum_nll()).abs() < 1e-9);
        assert!((seq.reference_sum_nll - d.reference_sum_nll()).abs() < 1e-9);
        let sum_dp: f64 = dp.iter().flatten().sum();
        let sum_dp2: f64 = dp.iter().flatten().map(|d| d * d).sum();
        assert!((seq.sum_delta_p - sum_dp).abs() < 1e-12);
        assert!((seq.sum_delta_p_squared - sum_dp2).abs() < 1e-12);
        scored += seq.num_scored;
    }
    assert_eq!(r.usage.scored_tokens, scored);

    // Sums only: the same numbers without the arrays.
    let body = json!({ "tokens": seqs[1], "per_token": false });
    let (status, text) = post(&server.base, "/kld", body).await;
    assert_eq!(status, 200, "{text}");
    let short: KldResponse = serde_json::from_str(&text).unwrap();
    assert!(short.sequences[0].kld.is_none() && short.sequences[0].delta_p.is_none());
    assert_eq!(short.sequences[0].sum_kld, r.sequences[1].sum_kld);

    // /info carries both models' bits per weight.
    let info = common::info(&server.base).await;
    let reference = info.reference.expect("reference in /info");
    assert_eq!(reference.model, REFERENCE);
    assert_eq!(reference.bits_per_weight, 16.0);
    assert!((info.bits_per_weight - 4.125).abs() < 1e-9);

    // Bad input is named like /score's.
    let (status, text) = post(&server.base, "/kld", json!({ "tokens": [1, 99999] })).await;
    assert_eq!(status, 422, "{text}");
    let e: ErrorBody = serde_json::from_str(&text).unwrap();
    assert_eq!(
        (e.field.as_deref(), e.rule.as_deref()),
        (Some("tokens[1]"), Some("below_vocab_size"))
    );
    let _ = server.stop.send(());
    server.done.await.unwrap().unwrap();
}

/// A one-token sequence scores nothing: its sums are 0, never -0 (an empty float sum).
#[tokio::test]
async fn a_one_token_sequence_sums_to_positive_zero() {
    let reference_dir = fixture(REFERENCE);
    let server = start(
        SERVED,
        &["--reference-model", reference_dir.to_str().unwrap()],
    )
    .await;
    for route in ["/score", "/kld"] {
        let (status, text) = post(&server.base, route, json!({ "tokens": [[1], [1, 2, 3]] })).await;
        assert_eq!(status, 200, "{text}");
        assert!(!text.contains("-0.0"), "{route}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        let first = &v["sequences"][0];
        assert_eq!(first["num_scored"], 0, "{route}");
        assert_eq!(
            first["sum_nll"].as_f64().unwrap().to_bits(),
            0f64.to_bits(),
            "{route}"
        );
    }
}

#[tokio::test]
async fn kld_without_a_reference_is_a_named_404() {
    let server = start(SERVED, &[]).await;
    let (status, text) = post(&server.base, "/kld", json!({ "tokens": [1, 2, 3] })).await;
    assert_eq!(status, 404, "{text}");
    let e: ErrorBody = serde_json::from_str(&text).unwrap();
    assert_eq!(e.kind, "no_reference_model");
    assert!(e.error.contains("--reference-model"), "{}", e.error);
    let _ = server.stop.send(());
    server.done.await.unwrap().unwrap();
}

#[tokio::test]
async fn a_reference_with_another_vocabulary_is_refused_at_start_up() {
    // The dense fixture with two tokens' ids swapped in its tokenizer.
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture(REFERENCE)).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.path().join(path.file_name().unwrap())).unwrap();
    }
    let path = dir.path().join("tokenizer.json");
    let mut tokenizer: Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let vocab = tokenizer["model"]["vocab"].as_object_mut().unwrap();
    let (a, b) = (vocab["a"].clone(), vocab["b"].clone());
    vocab.insert("a".into(), b.clone());
    vocab.insert("b".into(), a.clone());
    std::fs::write(&path, tokenizer.to_string()).unwrap();

    let served = fixture(SERVED);
    let args = Args::try_parse_from([
        "exactscore-server",
        "--model",
        served.to_str().unwrap(),
        "--reference-model",
        dir.path().to_str().unwrap(),
    ])
    .unwrap();
    let err = Server::load(&Config::from_args(args).unwrap())
        .await
        .err()
        .expect("a reference with another vocabulary must be refused")
        .to_string();
    let first = if a.as_u64() < b.as_u64() { "a" } else { "b" };
    assert!(err.contains("vocabulary differs"), "{err}");
    assert!(err.contains(&format!("token \"{first}\"")), "{err}");
}

/// `exactscore kld` (the runner with `Task::Kld`) over two servers, interrupted and resumed:
/// every aggregate equals the direct computation from per-token values of the model library.
#[tokio::test]
async fn kld_runner_aggregates_equal_a_direct_computation() {
    use exactscore_client::dataset::DatasetOptions;
    use exactscore_client::kld::quantile;
    use exactscore_client::windows::{windows, Method, WindowParams};
    use exactscore_client::{run_ppl, PplConfig, PplError, Task};

    let reference_dir = fixture(REFERENCE);
    let args = ["--reference-model", reference_dir.to_str().unwrap()];
    let servers = [start(SERVED, &args).await, start(SERVED, &args).await];
    let dir = tempfile::tempdir().unwrap();
    let spec = common::dataset(dir.path());
    let partial = dir.path().join("kld.partial.jsonl");
    let config = || {
        let mut c = PplConfig::new(
            servers.iter().map(|s| s.base.clone()).collect(),
            spec.clone(),
        );
        c.task = Task::Kld;
        c.method = Method::Exl3;
        (c.ctx, c.stride, c.max_windows, c.concurrency) = (64, 24, Some(10), 4);
        c.output = Some(partial.clone());
        c
    };
    let mut first = config();
    first.stop_after = Some(3);
    match run_ppl(first).await {
        Err(PplError::Interrupted { done, .. }) => assert!(done >= 3),
        other => panic!("expected an interruption, got {other:?}"),
    }
    let mut resumed = config();
    resumed.resume = true;
    let report = run_ppl(resumed).await.unwrap();
    assert!(report.resumed_windows >= 3);
    let k = report.kld.as_ref().expect("kld statistics");

    // Direct: same tokens, same windows, the model library's per-token divergences.
    let text = exactscore_client::dataset::load(&spec, &DatasetOptions::default())
        .unwrap()
        .text;
    let tok = tokenizers::Tokenizer::from_file(fixture(SERVED).join("tokenizer.json")).unwrap();
    let ids = tok.encode(text.as_str(), true).unwrap().get_ids().to_vec();
    let params = WindowParams {
        method: Method::Exl3,
        ctx: 64,
        stride: 24,
        prefix_token: None,
        max_windows: Some(10),
    };
    let (model, reference) = (load_model(SERVED), load_model(REFERENCE));
    let (mut kld, mut same, mut dp, mut dp2, mut nll, mut ref_nll) =
        (vec![], 0usize, 0f64, 0f64, 0f64, 0f64);
    let (mut reverse, mut agreement) = (0f64, [0usize; 5]);
    let mut by_confidence: Vec<Vec<f64>> = vec![vec![]; 5];
    for w in windows(ids.len(), &params).unwrap() {
        let seq = w.sequence(&ids);
        let d = kld_batch(&model, &reference, &[&seq]).unwrap().remove(0);
        for p in w.scored.clone() {
            let t = d.tokens[p - 1];
            reverse += t.reverse_kld;
            for (k, a) in agreement.iter_mut().enumerate() {
                *a += usize::from(t.top_k_agreement >> k & 1 == 1);
            }
            let top_p = t.reference_top_p;
            let bucket = [0.25, 0.5, 0.75, 0.95]
                .iter()
                .position(|&upper| top_p < upper)
                .unwrap_or(4);
            by_confidence[bucket].push(t.kld);
            kld.push(t.kld);
            same += usize::from(t.same_top);
            let delta = (t.logprob as f64).exp() - (t.reference_logprob as f64).exp();
            dp += delta;
            dp2 += delta * delta;
            nll -= t.logprob as f64;
            ref_nll -= t.reference_logprob as f64;
        }
    }
    let n = kld.len() as f64;
    assert_eq!(k.tokens, kld.len());
    let close = |got: f64, want: f64, what: &str| {
        assert!(
            (got - want).abs() <= 1e-9 * want.abs().max(1e-3),
            "{what}: {got} vs {want}"
        )
    };
    close(k.mean_kld, kld.iter().sum::<f64>() / n, "mean KLD");
    kld.sort_by(f64::total_cmp);
    close(k.median_kld, quantile(&kld, 0.5), "median");
    close(k.p99_kld, quantile(&kld, 0.99), "p99");
    close(k.max_kld, *kld.last().unwrap(), "max");
    close(k.same_top, same as f64 / n, "same top");
    close(k.mean_delta_p, dp / n, "mean Δp");
    close(k.rms_delta_p, (dp2 / n).sqrt(), "RMS Δp");
    close(k.perplexity, (nll / n).exp(), "perplexity");
    close(
        k.reference_perplexity,
        (ref_nll / n).exp(),
        "reference perplexity",
    );
    close(
        report.stats.perplexity,
        (nll / n).exp(),
        "report perplexity",
    );
    close(
        k.perplexity_ratio,
        k.perplexity / k.reference_perplexity,
        "ratio",
    );
    close(k.mean_reverse_kld, reverse / n, "mean reverse KLD");
    for (i, a) in agreement.iter().enumerate() {
        close(k.top_k_agreement[i], *a as f64 / n, "top-K agreement");
    }
    close(
        k.top_k_agreement[0],
        k.same_top,
        "top-1 agreement is same top",
    );
    close(k.p25_kld, quantile(&kld, 0.25), "p25");
    close(k.p75_kld, quantile(&kld, 0.75), "p75");
    for (b, mut values) in k.confidence_buckets.iter().zip(by_confidence) {
        assert_eq!(b.tokens, values.len(), "bucket [{}, {})", b.lower, b.upper);
        if let Some(mean) = b.mean_kld {
            close(
                mean,
                values.iter().sum::<f64>() / values.len() as f64,
                "bucket mean",
            );
            values.sort_by(f64::total_cmp);
            close(
                b.median_kld.unwrap(),
                quantile(&values, 0.5),
                "bucket median",
            );
        }
    }
    assert!(k.confidence_buckets.iter().filter(|b| b.tokens > 0).count() >= 2);
    assert!(k.mean_kld > 0.0 && k.same_top < 1.0);
    let table = report.to_table();
    for row in [
        "mean KLD",
        "reverse KLD",
        "top-K agreement",
        "KLD, top p [0.00,0.25)",
        "KLD p99.9",
        "same top token",
        "RMS Δp",
        "PPL ratio",
    ] {
        assert!(table.contains(row), "{row} missing from\n{table}");
    }
    assert!(
        table.contains("reference bits per weight  16.0000"),
        "{table}"
    );
}

/// The noise floor: the dense checkpoint served in bf16 with itself in f32 as the reference.
/// `--reference-dtype` makes the reference f32 (its KLD from an f32 run of the same checkpoint
/// is 0 where bf16's is not), and `exactscore kld --noise-floor-server` reports it beside the
/// quantization's KLD over the very same windows.
#[tokio::test]
async fn noise_floor_is_the_kld_of_bf16_arithmetic_on_the_same_windows() {
    use exactscore_client::{run_ppl, PplConfig, Task};

    let reference_dir = fixture(REFERENCE);
    let reference_dir = reference_dir.to_str().unwrap();
    let quantized = start(SERVED, &["--reference-model", reference_dir]).await;
    let floor_args = [
        "--dtype",
        "bf16",
        "--reference-model",
        reference_dir,
        "--reference-dtype",
        "f32",
    ];
    let floor = start(REFERENCE, &floor_args).await;

    let info = common::info(&floor.base).await;
    assert_eq!(info.dtype, "bf16");
    assert_eq!(info.reference.unwrap().dtype.as_deref(), Some("f32"));

    // The f32 reference of the floor server is the f32 model itself: against an f32 run of the
    // same checkpoint its divergence is exactly 0, so the floor measures bf16 alone.
    let seq: Vec<u32> = fixture_sequences()[0].clone();
    let (status, text) = post(&floor.base, "/kld", json!({ "tokens": seq })).await;
    assert_eq!(status, 200, "{text}");
    let r: KldResponse = serde_json::from_str(&text).unwrap();
    let dense = load_model(REFERENCE);
    let f32_self = kld_batch(&dense, &dense, &[&seq]).unwrap().remove(0);
    assert_eq!(f32_self.sum_kld(), 0.0);
    let bf16_floor = r.sequences[0].sum_kld / r.sequences[0].num_scored as f64;
    assert!(bf16_floor > 0.0, "bf16 arithmetic moved nothing?");
    for (i, t) in f32_self.tokens.iter().enumerate() {
        let reference_lp = r.sequences[0].reference_logprobs.as_ref().unwrap()[i + 1];
        assert_eq!(
            reference_lp,
            Some(t.reference_logprob),
            "position {}",
            i + 1
        );
    }

    let dir = tempfile::tempdir().unwrap();
    let mut config = PplConfig::new(vec![quantized.base.clone()], common::dataset(dir.path()));
    config.task = Task::Kld;
    (config.ctx, config.stride, config.max_windows) = (64, 32, Some(4));
    config.noise_floor_server = Some(floor.base.clone());
    let report = run_ppl(config.clone()).await.unwrap();
    let k = report.kld.as_ref().unwrap();
    let nf = report
        .noise_floor
        .as_ref()
        .expect("noise floor in the report");
    // The floor equals a plain `exactscore kld` run against the floor server.
    let mut plain = config.clone();
    plain.servers = vec![floor.base.clone()];
    plain.noise_floor_server = None;
    let direct = run_ppl(plain).await.unwrap();
    assert_eq!(nf.kld, *direct.kld.as_ref().unwrap());
    assert_eq!(nf.kld.tokens, k.tokens);
    println!(
        "W4A16 mean KLD {:.6}, bf16 noise floor {:.6} over {} tokens",
        k.mean_kld, nf.kld.mean_kld, k.tokens
    );
    assert!(nf.kld.mean_kld > 0.0 && nf.kld.mean_kld < k.mean_kld / 10.0);
    let table = report.to_table();
    assert!(table.contains("noise floor mean KLD"), "{table}");
    assert!(
        table.contains("in bf16 vs llama-dense-bf16 in f32"),
        "{table}"
    );

    // Issue 37: a server of the quantized model against its original (W4A16 vs bf16) is no
    // noise floor: refused before the main run, saying why.
    config.noise_floor_server = Some(quantized.base.clone());
    let err = run_ppl(config.clone()).await.unwrap_err().to_string();
    assert!(
        err.contains("not one checkpoint twice") && err.contains("--reference-dtype f32"),
        "{err}"
    );

    // A server without a reference is refused before the main run, naming the option.
    let plain_server = start(REFERENCE, &[]).await;
    config.noise_floor_server = Some(plain_server.base.clone());
    let err = run_ppl(config).await.unwrap_err().to_string();
    assert!(
        err.contains("noise-floor server") && err.contains("--reference-dtype"),
        "{err}"
    );
    for s in [quantized, floor, plain_server] {
        let _ = s.stop.send(());
        s.done.await.unwrap().unwrap();
    }
}

/// `exactscore kld` over one 2600-token window: its NLL and KLD by position bucket (0–2K,
/// 2K–8K) equal the same sums of the model library's per-token numbers, and the table shows
/// them.
#[tokio::test]
async fn kld_by_position_equals_a_direct_computation() {
    use exactscore_client::dataset::{DatasetOptions, DatasetSpec};
    use exactscore_client::windows::{windows, Method, WindowParams};
    use exactscore_client::{run_ppl, PplConfig, Task};
    use exactscore_server::model::{Model, ModelOptions};

    let reference_dir = fixture(REFERENCE);
    let args = [
        "--reference-model",
        reference_dir.to_str().unwrap(),
        "--max-input-tokens",
        "4096",
        "--max-batch-tokens",
        "4096",
    ];
    let server = common::start_dir(&fixture(SERVED), &args).await;
    let dir = tempfile::tempdir().unwrap();
    let gz = fixture("corpus").join("wikitext-2-raw-test.txt.gz");
    let text = exactscore_client::dataset::wikitext2_text(&gz).unwrap();
    let cut = text.char_indices().nth(20_000).unwrap().0;
    let path = dir.path().join("long.txt");
    std::fs::write(&path, &text[..cut]).unwrap();
    let spec = DatasetSpec::Txt(path);
    let params = WindowParams {
        method: Method::Exl3,
        ctx: 2600,
        stride: 2600,
        prefix_token: None,
        max_windows: Some(1),
    };
    let mut config = PplConfig::new(vec![server.base.clone()], spec.clone());
    config.task = Task::Kld;
    (config.method, config.ctx, config.stride, config.max_windows) =
        (params.method, params.ctx, params.stride, params.max_windows);
    let report = run_ppl(config).await.unwrap();

    let text = exactscore_client::dataset::load(&spec, &DatasetOptions::default())
        .unwrap()
        .text;
    let tok = tokenizers::Tokenizer::from_file(fixture(SERVED).join("tokenizer.json")).unwrap();
    let ids = tok.encode(text.as_str(), true).unwrap().get_ids().to_vec();
    let mut opts: ModelOptions = common::load_model_options();
    opts.max_seq_len = params.ctx;
    let load = |name| Model::load(&fixture(name), &opts).unwrap();
    let w = windows(ids.len(), &params).unwrap().remove(0);
    let d = kld_batch(&load(SERVED), &load(REFERENCE), &[&w.sequence(&ids)]).unwrap();
    // (tokens, Σ NLL, Σ KLD) of positions 1..2048 and 2048..2600
    let mut want = [(0usize, 0f64, 0f64); 2];
    for p in w.scored.clone() {
        let t = d[0].tokens[p - 1];
        let b = &mut want[usize::from(p >= 2048)];
        (b.0, b.1, b.2) = (b.0 + 1, b.1 - t.logprob as f64, b.2 + t.kld);
    }
    let got = &report.position_buckets;
    assert_eq!(got.len(), 2, "{got:?}");
    for (b, (tokens, nll, kld)) in got.iter().zip(want) {
        assert_eq!(b.tokens, tokens);
        let n = tokens as f64;
        assert!((b.mean_nll - nll / n).abs() <= 1e-9 * (nll / n), "{b:?}");
        assert!((b.perplexity - (nll / n).exp()).abs() <= 1e-9 * b.perplexity);
        let mean_kld = b.mean_kld.unwrap();
        assert!((mean_kld - kld / n).abs() <= 1e-9 * (kld / n), "{b:?}");
    }
    assert_eq!((got[0].lower, got[0].upper), (0, Some(2048)));
    assert_eq!((got[1].lower, got[1].upper), (2048, Some(8192)));
    let table = report.to_table();
    for row in ["positions 0–2K", "positions 2K–8K"] {
        assert!(table.contains(row), "{row} missing from\n{table}");
    }
    let json: Value = serde_json::to_value(&report).unwrap();
    assert_eq!(json["position_buckets"][1]["tokens"], want[1].0);
}

/// `--kv-cache-dtype fp8_e4m3` with the same checkpoint as the reference: `/info` labels the
/// simulation, and `/kld` measures what the fp8 KV cache alone costs (the weights are the
/// same; the reference never takes the served model's KV flags): exactly zero without the
/// flag, with it 31.2 nats over the 551 scored tokens (0.057 per token).
#[tokio::test]
async fn kld_measures_a_simulated_fp8_kv_cache() {
    const KV: &str = "llama-kv-none";
    let dir = fixture(KV);
    let seqs = common::reference_sequences(KV);
    let mut sums = Vec::new();
    for simulate in [false, true] {
        let mut args = vec!["--reference-model", dir.to_str().unwrap()];
        if simulate {
            args.extend(["--kv-cache-dtype", "fp8_e4m3"]);
        }
        let server = start(KV, &args).await;
        let info = common::info(&server.base).await;
        match simulate {
            true => assert!(
                info.kv_cache.as_deref().unwrap().starts_with("simulation"),
                "{:?}",
                info.kv_cache
            ),
            false => assert_eq!(info.kv_cache, None),
        }
        let (status, text) = post(&server.base, "/kld", json!({ "tokens": seqs })).await;
        assert_eq!(status, 200, "{text}");
        let r: KldResponse = serde_json::from_str(&text).unwrap();
        sums.push(r.sequences.iter().map(|s| s.sum_kld).sum::<f64>());
    }
    println!("sum KLD without / with the simulated fp8 KV cache: {sums:?}");
    assert_eq!(sums[0], 0.0);
    assert!(sums[1] > 1e-3, "{sums:?}");
}

/// `/info` reports both KV-cache flags, and the server command line a report writes for
/// reproduction (`exactscore_client::record::server_command`) gives them back to the server:
/// parsed as the server parses its arguments, it loads with the same KV-cache options.
#[tokio::test]
async fn the_kv_cache_flags_are_reported_and_reproduced() {
    let cases: [(&str, &[&str], &str, &str); 3] = [
        ("llama-kv-fp8-tensor", &[], "emulate", "auto"),
        (
            "llama-kv-fp8-tensor",
            &["--kv-cache-quant", "off"],
            "off",
            "auto",
        ),
        (
            "llama-kv-none",
            &["--kv-cache-dtype", "fp8_e4m3"],
            "emulate",
            "fp8_e4m3",
        ),
    ];
    for (variant, flags, quant, dtype) in cases {
        let server = start(variant, flags).await;
        let info = common::info(&server.base).await;
        assert_eq!(
            (
                info.kv_cache_quant_mode.as_str(),
                info.kv_cache_dtype.as_str()
            ),
            (quant, dtype),
            "{variant} {flags:?}"
        );
        // Emulated or simulated: named; off: absent.
        assert_eq!(
            info.kv_cache.is_some(),
            quant == "emulate",
            "{:?}",
            info.kv_cache
        );
        let line = exactscore_client::record::server_command(&info);
        let words = line.split(' ').map(|w| w.trim_matches('\''));
        let mut args = Args::try_parse_from(words).unwrap_or_else(|e| panic!("{line}: {e}"));
        args.model = fixture(variant);
        let reproduced = Config::from_args(args).unwrap().kv_cache;
        let original = {
            let mut args = Args::try_parse_from(["exactscore-server"].iter().chain(flags)).unwrap();
            args.model = fixture(variant);
            Config::from_args(args).unwrap().kv_cache
        };
        assert_eq!(reproduced, original, "{line}");
    }
}
