//! End to end: `exactscore reference save` on a server of the dense original, then `exactscore
//! kld --reference-file` on a server of the W4A16 variant that has no reference model: the
//! bounds contain the KLD that a co-resident reference gives over the same windows (`exactscore
//! kld`), the served perplexity is the same, and a run whose windows or dataset differ is
//! refused, naming what differs.

mod common;

use common::{dataset, fixture, start};
use exactscore_client::reference::{self, ReferenceFile};
use exactscore_client::runner::{run_ppl, PplConfig};
use exactscore_client::windows::Method;
use exactscore_client::Task;

const SERVED: &str = "llama-w4a16-g128";
const REFERENCE: &str = "llama-dense-bf16";

fn config(base: &str, spec: &exactscore_client::dataset::DatasetSpec) -> PplConfig {
    let mut cfg = PplConfig::new(vec![base.to_string()], spec.clone());
    cfg.method = Method::Exl3;
    cfg.ctx = 64;
    cfg.stride = 24;
    cfg.max_windows = Some(6);
    cfg.progress = false;
    cfg
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_reference_bounds_the_co_resident_divergence() {
    let dir = tempfile::tempdir().unwrap();
    let spec = dataset(dir.path());
    let path = dir.path().join("dense.esref");

    let reference_server = start(REFERENCE, &[]).await;
    let saved = reference::save(&config(&reference_server.base, &spec), 32, &path)
        .await
        .unwrap();
    let _ = reference_server.stop.send(());
    let file = ReferenceFile::read(&path).unwrap();
    assert_eq!(file, saved, "the file reads back as written");
    let rows: usize = file.header.layout.iter().map(|w| w.rows).sum();
    // Header, tokens, and per row 32 ids + 32 log-probabilities + a tail log-mass.
    let body: usize = file.header.layout.iter().map(|w| w.len * 4).sum::<usize>() + rows * 260;
    assert!(std::fs::metadata(&path).unwrap().len() as usize > body);

    let reference_dir = fixture(REFERENCE);
    let served = start(
        SERVED,
        &["--reference-model", reference_dir.to_str().unwrap()],
    )
    .await;
    let cfg = config(&served.base, &spec);
    let stored = reference::kld(&cfg, &file).await.unwrap();
    let mut co_resident = config(&served.base, &spec);
    co_resident.task = Task::Kld;
    let exact = run_ppl(co_resident).await.unwrap();
    let kld = exact.kld.unwrap();
    assert_eq!(stored.positions, kld.tokens);
    assert!(
        stored.mean_kld_lower <= kld.mean_kld && kld.mean_kld <= stored.mean_kld_upper,
        "{} outside [{}, {}]",
        kld.mean_kld,
        stored.mean_kld_lower,
        stored.mean_kld_upper
    );
    assert!((stored.perplexity / exact.stats.perplexity - 1.0).abs() < 1e-9);
    println!(
        "k 32: mean KLD {} in [{}, {}], estimate {}",
        kld.mean_kld, stored.mean_kld_lower, stored.mean_kld_upper, stored.mean_kld_estimate
    );

    // Other windows, or another text: refused, naming what differs.
    let mut other = config(&served.base, &spec);
    other.stride = 32;
    let e = reference::kld(&other, &file).await.unwrap_err().to_string();
    assert!(e.contains("windows: stride 32 (file: 24)"), "{e}");
    let text = dir.path().join("other.txt");
    std::fs::write(&text, "another text ".repeat(400)).unwrap();
    let other = config(
        &served.base,
        &exactscore_client::dataset::DatasetSpec::Txt(text),
    );
    let e = reference::kld(&other, &file).await.unwrap_err().to_string();
    assert!(e.contains("dataset sha256"), "{e}");
    let _ = served.stop.send(());
}

/// llama.cpp's base file written from the dense server (its windows: chunks of n_ctx, second
/// halves), read back bit for bit, then scored by the W4A16 server: with every token kept the
/// bounds close on the divergence from the 16-bit rows, within their quantization of the exact
/// co-resident one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_llama_cpp_base_file_round_trips_and_scores() {
    use exactscore_client::llamacpp::{chunk_sequence, kld_base, save_base, BaseFile};
    let dir = tempfile::tempdir().unwrap();
    let spec = dataset(dir.path());
    let path = dir.path().join("dense.kld-base");
    let reference_server = start(REFERENCE, &[]).await;
    let mut cfg = config(&reference_server.base, &spec);
    cfg.max_windows = Some(4);
    let written = save_base(&cfg, &path).await.unwrap();
    let _ = reference_server.stop.send(());
    let bytes = std::fs::read(&path).unwrap();
    let file = BaseFile::from_bytes(&bytes).unwrap();
    assert_eq!(file, written);
    assert_eq!(file.to_bytes(), bytes);
    assert_eq!((file.n_ctx, file.n_vocab, file.n_chunk), (64, 2000, 4));
    assert_eq!(bytes.len(), 20 + 4 * 64 * 4 + 2 * 4 * 31 * (2000 + 4));

    let reference_dir = fixture(REFERENCE);
    let served = start(
        SERVED,
        &["--reference-model", reference_dir.to_str().unwrap()],
    )
    .await;
    let cfg = config(&served.base, &spec);
    let client = exactscore_client::reference::connect(&cfg).unwrap();
    let info = client.tokenizer_info().await.unwrap();
    let bos = info.bos_token_id.filter(|_| info.add_bos_token);
    let (mut exact, mut n) = (0f64, 0usize);
    for c in 0..4 {
        let seq = chunk_sequence(file.chunk(c), bos);
        let kld = client.kld_tokens(&seq).await.unwrap().kld.unwrap();
        exact += kld[33..64].iter().map(|v| v.unwrap()).sum::<f64>();
        n += 31;
    }
    let exact = exact / n as f64;
    let all = kld_base(&cfg, &file, 2000).await.unwrap();
    let top = kld_base(&cfg, &file, 64).await.unwrap();
    assert_eq!((all.positions, top.positions), (n, n));
    assert!(all.mean_kld_upper - all.mean_kld_lower < 1e-5, "{all:?}");
    assert!(
        (all.mean_kld_estimate - exact).abs() < 2e-3,
        "{all:?} vs {exact}"
    );
    assert!(top.mean_kld_lower <= all.mean_kld_lower + 1e-9);
    assert!(all.mean_kld_upper <= top.mean_kld_upper + 1e-9);
    println!(
        "llama.cpp base: exact {exact}, all tokens {}, k 64 [{}, {}]",
        all.mean_kld_estimate, top.mean_kld_lower, top.mean_kld_upper
    );
    let _ = served.stop.send(());
}
