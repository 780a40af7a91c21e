//! The `exactscore` binary against a fake server: ppl → report → compare + plots, score.

mod common;

use std::process::Output;

use common::{fake_app, spawn, Fake};
use exactscore_client::report::NoiseFloor;
use exactscore_client::{KldStats, KldWindow, Report};

async fn exactscore(args: Vec<String>) -> Output {
    tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_exactscore"))
            .args(&args)
            .env_remove("EXACTSCORE_API_KEY")
            .env_remove("EXACTSCORE_SERVER")
            .output()
            .unwrap()
    })
    .await
    .unwrap()
}

fn s(v: &[&str]) -> Vec<String> {
    v.iter().map(|x| x.to_string()).collect()
}

#[tokio::test]
async fn ppl_compare_plot_and_score() {
    let dir = tempfile::tempdir().unwrap();
    let url = spawn(fake_app(Fake::new(Some("k")))).await;
    let data = dir.path().join("d.txt");
    std::fs::write(
        &data,
        "a few words of text to score, again and again. ".repeat(60),
    )
    .unwrap();
    let mut reports = vec![];
    for (i, method) in ["exl3", "disjoint", "rolling"].iter().enumerate() {
        let json = dir.path().join(format!("r{i}.json"));
        let out = exactscore(s(&[
            "ppl",
            "--server",
            &url,
            "--api-key",
            "k",
            "--dataset",
            data.to_str().unwrap(),
            "--method",
            method,
            "--ctx",
            "48",
            "--stride",
            "16",
            "--concurrency",
            "3",
            "--no-progress",
            "--json",
            json.to_str().unwrap(),
        ]))
        .await;
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            stdout.contains("perplexity") && stdout.contains("bits per byte"),
            "{stdout}"
        );
        let r: Report = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        assert!(r.stats.perplexity > 1.0);
        reports.push(json.to_str().unwrap().to_string());
    }
    // Issue 37: three methods are three measurements: refused, naming what differs...
    let mut args = s(&["compare"]);
    args.extend(reports.iter().cloned());
    let out = exactscore(args).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("r1.json: method disjoint vs exl3") && stderr.contains("--allow-mismatch"),
        "{stderr}"
    );
    assert!(!stderr.contains("tokens (tokenizer)"), "{stderr}");
    // ... and shown marked with --allow-mismatch.
    for ext in ["png", "svg"] {
        let plot = dir.path().join(format!("cmp.{ext}"));
        let mut args = s(&["compare", "--allow-mismatch"]);
        args.extend(reports.iter().cloned());
        args.extend(s(&["--plot", plot.to_str().unwrap()]));
        let out = exactscore(args).await;
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let table = String::from_utf8_lossy(&out.stdout);
        assert_eq!(table.lines().count(), 4, "{table}");
        assert!(
            table.contains("fake-llama") && table.contains("4.250"),
            "{table}"
        );
        assert!(table.contains("(≠ method rolling vs exl3"), "{table}");
        let bytes = std::fs::read(&plot).unwrap();
        if ext == "png" {
            assert_eq!(&bytes[..4], b"\x89PNG");
        } else {
            let svg = String::from_utf8(bytes).unwrap();
            assert!(
                svg.contains("<svg")
                    && svg.contains("Perplexity vs bits per weight")
                    && svg.contains("(≠ method")
            );
        }
    }

    // `exactscore kld` reports: the table gains their mean KLD and same-top, the plot's left
    // panel shows mean KLD against bits per weight.
    let mut kld_reports = vec![];
    // Three of one run (the exl3 one), as three quantizations of one model would be.
    for i in 0..reports.len() {
        let path = &reports[0];
        let mut r: Report = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let mean_kld = 0.125 * (i + 1) as f64;
        // Fewer bits, more divergence: 5, 4, 3 bits per weight.
        r.server_info.as_mut().unwrap().bits_per_weight = 5.0 - i as f64;
        for w in &mut r.per_window {
            w.kld = Some(KldWindow {
                reference_sum_nll: w.sum_nll,
                same_top: 0,
                sum_delta_p: 0.0,
                sum_delta_p_squared: 0.0,
                sum_ln_ratio_squared: 0.0,
                kld: (0..w.count)
                    .map(|t| mean_kld * (t % 4) as f64 / 2.0)
                    .collect(),
                sum_reverse_kld: 0.0,
                sum_reverse_kld_squared: 0.0,
                top_k_agreement: vec![0; 5],
                reference_top_p: vec![0.5; w.count],
            });
        }
        r.kld = Some(KldStats {
            tokens: r.stats.tokens_scored,
            mean_kld,
            mean_kld_stderr: Some(0.01),
            median_kld: mean_kld,
            p90_kld: mean_kld,
            p99_kld: mean_kld,
            p99_9_kld: mean_kld,
            max_kld: mean_kld,
            same_top: 0.5,
            same_top_stderr: Some(0.01),
            mean_delta_p: 0.0,
            mean_delta_p_stderr: Some(0.0),
            rms_delta_p: 0.1,
            perplexity: r.stats.perplexity,
            reference_perplexity: r.stats.perplexity,
            perplexity_ratio: 1.0,
            perplexity_ratio_stderr: Some(0.0),
            ln_perplexity_ratio: 0.0,
            ln_perplexity_ratio_stderr: Some(0.0),
            p10_kld: 0.0,
            p25_kld: mean_kld / 2.0,
            p75_kld: 2.0 * mean_kld,
            mean_reverse_kld: mean_kld,
            mean_reverse_kld_stderr: None,
            top_k_agreement: vec![0.5; 5],
            confidence_buckets: vec![],
            histogram: vec![],
        });
        if i == 0 {
            r.noise_floor = Some(NoiseFloor {
                servers: vec!["http://floor".into()],
                server_info: None,
                kld: KldStats {
                    median_kld: 0.004,
                    ..r.kld.clone().unwrap()
                },
                wall_time_s: 1.0,
            });
        }
        let kld_path = dir.path().join(format!("kld{i}.json"));
        std::fs::write(&kld_path, serde_json::to_string(&r).unwrap()).unwrap();
        kld_reports.push(kld_path.to_str().unwrap().to_string());
    }
    // The spread band's points: by bits per weight, each report's quartiles.
    let loaded: Vec<(String, Report)> = kld_reports
        .iter()
        .map(|p| {
            let r = serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
            (p.clone(), r)
        })
        .collect();
    let points = exactscore_client::plot::spread_points(&loaded);
    let summary: Vec<(usize, f64, f64, f64)> = points
        .iter()
        .map(|p| (p.report, p.bits_per_weight, p.p25, p.p75))
        .collect();
    assert_eq!(
        summary,
        [
            (2, 3.0, 0.1875, 0.75),
            (1, 4.0, 0.125, 0.5),
            (0, 5.0, 0.0625, 0.25)
        ]
    );
    let png = dir.path().join("kld.png");
    let plot = dir.path().join("kld.svg");
    for path in [&png, &plot] {
        let mut args = s(&["compare"]);
        args.extend(kld_reports.iter().cloned());
        args.extend(s(&["--plot", path.to_str().unwrap()]));
        let out = exactscore(args).await;
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    assert_eq!(&std::fs::read(&png).unwrap()[..4], b"\x89PNG");
    let out = exactscore(s(&["compare", &kld_reports[0]])).await;
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table.contains("mean KLD") && table.contains("0.125000") && table.contains("50.00"),
        "{table}"
    );
    let svg = std::fs::read_to_string(&plot).unwrap();
    for text in [
        "Mean KLD vs bits per weight",
        "KLD spread vs bits per weight (median, p25–p75)",
        "per-token KLD (nats, log scale)",
        "Per-token KLD histogram",
        "tokens (% per bin)",
        "bf16 noise floor (median)",
    ] {
        assert!(svg.contains(text), "{text} missing from the plot");
    }
    // The band is one filled polygon.
    assert!(svg.contains("<polygon"), "no band in the plot");

    let out = exactscore(s(&[
        "score",
        "--server",
        &url,
        "--api-key",
        "k",
        "--text",
        "hello world",
        "--color",
        "never",
    ]))
    .await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(
        stdout.contains("logprob") && stdout.contains("perplexity"),
        "{stdout}"
    );
    assert!(!stdout.contains('\x1b'), "no colour with --color never");
    let out = exactscore(s(&[
        "score",
        "--server",
        &url,
        "--api-key",
        "k",
        "--text",
        "hello world",
        "--color",
        "always",
    ]))
    .await;
    assert!(String::from_utf8(out.stdout).unwrap().contains('\x1b'));
}

/// `exactscore diff --from`: saved reports printed (layer and attribution tables) and drawn on
/// one chart; without a server or a report it names what is missing.
#[tokio::test]
async fn diff_reports_print_and_plot() {
    use exactscore_client::diff::{AttributionSummary, FinalKld, LayerSummary};
    use exactscore_client::DiffReport;

    let dir = tempfile::tempdir().unwrap();
    let report = |scale: f64| DiffReport {
        server: "http://gpu0:8000".into(),
        server_info: None,
        dataset: "wikitext2".into(),
        ctx: 2048,
        windows: 4,
        tokens: 8192,
        reference_until: None,
        layers: (0..3)
            .map(|layer| LayerSummary {
                layer,
                mean_cos_error: scale * (layer + 1) as f64 * 1e-3,
                mean_sqnr_db: 30.0 - 5.0 * layer as f64 - scale,
                reference_state_after: false,
            })
            .collect(),
        kld: FinalKld {
            positions: 8188,
            mean_kld: 0.05 * scale,
            mean_reverse_kld: 0.049 * scale,
            top_k_agreement: vec![0.9, 0.8, 0.7, 0.6, 0.5],
        },
        attribution: Some(AttributionSummary {
            positions: 8188,
            full_kld: 0.05 * scale,
            sum_module_kld: 0.045 * scale,
            additivity_ratio: Some(0.9),
            modules: (0..25)
                .map(|m| exactscore_api::ModuleAttribution {
                    module: format!("model.layers.{m}.mlp.down_proj"),
                    format: "int4 g128 sym".into(),
                    mean_kld: 0.01 / (m + 1) as f64,
                })
                .collect(),
        }),
        wall_time_s: 1.5,
    };
    let paths: Vec<String> = [1.0, 2.0]
        .iter()
        .enumerate()
        .map(|(i, &scale)| {
            let p = dir.path().join(format!("diff{i}.json"));
            std::fs::write(&p, serde_json::to_string(&report(scale)).unwrap()).unwrap();
            p.to_str().unwrap().to_string()
        })
        .collect();
    let png = dir.path().join("layers.png");
    let mut args = s(&["diff", "--top", "3", "--plot", png.to_str().unwrap()]);
    for p in &paths {
        args.extend(s(&["--from", p]));
    }
    let out = exactscore(args).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(
        stdout.contains("module attribution: top 3 of 25 modules"),
        "{stdout}"
    );
    assert!(stdout.contains("model.layers.2.mlp.down_proj"), "{stdout}");
    assert!(
        !stdout.contains("model.layers.3.mlp.down_proj"),
        "only the top 3: {stdout}"
    );
    assert!(stdout.contains("additivity ratio 0.9000"), "{stdout}");
    assert!(
        stdout.contains("    2     6.0000e-3     18.000"),
        "{stdout}"
    );
    assert_eq!(&std::fs::read(&png).unwrap()[..4], b"\x89PNG");

    let out = exactscore(s(&["diff"])).await;
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--server"));
}
