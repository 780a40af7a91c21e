//! The real server in-process on 127.0.0.1:0, shared by the end-to-end tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use clap::Parser;
use exactscore_server::app::Server;
use exactscore_server::config::{Args, Config};
use tokio::sync::oneshot;

pub fn fixture(variant: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(variant)
}

/// The token ids of the fixture's reference sequences (17, 59, 223 and 256 ids).
pub fn reference_sequences(variant: &str) -> Vec<Vec<u32>> {
    let text = std::fs::read_to_string(fixture(variant).join("reference.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["sequences"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| serde_json::from_value(s["token_ids"].clone()).unwrap())
        .collect()
}

/// `POST {base}{route}` with a JSON body: the status and the body's text.
pub async fn post(base: &str, route: &str, body: serde_json::Value) -> (u16, String) {
    let res = reqwest::Client::new()
        .post(format!("{base}{route}"))
        .json(&body)
        .send()
        .await
        .unwrap();
    (res.status().as_u16(), res.text().await.unwrap())
}

/// `GET {base}/info`.
pub async fn info(base: &str) -> exactscore_api::ModelInfo {
    reqwest::get(format!("{base}/info"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// [`post`] that must answer 200: the body's text.
pub async fn post_ok(base: &str, route: &str, body: serde_json::Value) -> String {
    let (status, text) = post(base, route, body).await;
    assert_eq!(status, 200, "{route}: {text}");
    text
}

/// A few KiB of WikiText-2 as a `.txt` dataset in `dir`.
pub fn dataset(dir: &Path) -> exactscore_client::dataset::DatasetSpec {
    let gz = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/corpus/wikitext-2-raw-test.txt.gz");
    let text = exactscore_client::dataset::wikitext2_text(&gz).unwrap();
    let cut = text.char_indices().nth(3000).unwrap().0;
    let path = dir.join("sample.txt");
    std::fs::write(&path, &text[..cut]).unwrap();
    exactscore_client::dataset::DatasetSpec::Txt(path)
}

/// A fixture model as the server loads it by default (f32, CPU, activation QDQ emulated).
pub fn load_model(variant: &str) -> exactscore_server::model::Model {
    exactscore_server::model::Model::load(&fixture(variant), &load_model_options()).unwrap()
}

/// The options of [`load_model`]: sequences of up to 512 tokens.
pub fn load_model_options() -> exactscore_server::model::ModelOptions {
    use exactscore_server::model::ModelOptions;
    use exactscore_server::quant::{ActivationQuantMode, LinearOptions};
    ModelOptions {
        linear: LinearOptions {
            device: candle_core::Device::Cpu,
            dtype: candle_core::DType::F32,
            activation_quant: ActivationQuantMode::Emulate,
            kv_cache: Default::default(),
            fp8_matmul: Default::default(),
            fused_fp8_scales: Default::default(),
        },
        max_seq_len: 512,
        attention: Default::default(),
    }
}

pub struct Running {
    pub base: String,
    pub stop: oneshot::Sender<()>,
    pub done: tokio::task::JoinHandle<std::io::Result<exactscore_server::app::Shutdown>>,
}

/// The real server, loaded from a fixture (f32, CPU), serving on 127.0.0.1:0.
pub async fn start(variant: &str, extra_args: &[&str]) -> Running {
    let mut args = vec!["--max-input-tokens", "512", "--max-batch-tokens", "2048"];
    args.extend_from_slice(extra_args);
    start_dir(&fixture(variant), &args).await
}

/// The real server on the checkpoint in `model` with `args`, serving on 127.0.0.1:0.
pub async fn start_dir(model: &Path, args: &[&str]) -> Running {
    let args = Args::try_parse_from(
        ["exactscore-server", "--model", model.to_str().unwrap()]
            .into_iter()
            .chain(args.iter().copied()),
    )
    .unwrap();
    let config = Config::from_args(args).unwrap();
    let server = Server::load(&config).await.unwrap();
    server.warm_up().await.unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let (stop, stopped) = oneshot::channel::<()>();
    let done = tokio::spawn(server.serve(listener, async {
        let _ = stopped.await;
    }));
    Running { base, stop, done }
}
