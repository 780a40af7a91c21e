//! One model across several devices, through HTTP on the CPU: pipeline stages (`--device
//! cpu,cpu[,cpu]`), replicas (`--replicas 2`), both at once, and micro-batches of 1 and 3
//! sequences give every logprob, top-k entry and divergence bit for bit as one device does, for
//! every fixture format, the reference model split too. Logical devices run the same code as
//! GPUs (a thread per stage, hidden states handed over between them).

use std::path::Path;

use serde_json::{json, Value};

mod common;

use common::fixture;

const FORMATS: [&str; 7] = [
    "llama-dense-bf16",
    "llama-w4a16-g128",
    "llama-w4a16-asym-g64",
    "llama-w8a16-channel",
    "llama-nvfp4",
    "llama-nvfp4a16",
    "llama-fp8-dynamic",
];
const REFERENCE: &str = "llama-dense-bf16";

/// Layers of the 4-layer copies, by the fixture layer they copy: no stage order would give the
/// same sequence of layers, so a stage run out of turn changes the numbers.
const LAYER_SOURCES: [usize; 4] = [0, 1, 1, 1];

/// Fixture `variant` with 4 decoder layers (copies of its 2), so that 3 stages have a layer
/// each, in a temp dir with its tokenizer.
fn four_layer_copy(variant: &str) -> tempfile::TempDir {
    let src = fixture(variant);
    let dir = tempfile::tempdir().unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, safetensors::tensor::TensorView<'_>)> = Vec::new();
    for (name, view) in st.tensors() {
        match name.strip_prefix("model.layers.") {
            Some(rest) => {
                let (layer, suffix) = rest.split_once('.').unwrap();
                let layer: usize = layer.parse().unwrap();
                for (to, &from) in LAYER_SOURCES.iter().enumerate() {
                    if from == layer {
                        tensors.push((format!("model.layers.{to}.{suffix}"), view.clone()));
                    }
                }
            }
            None => tensors.push((name, view)),
        }
    }
    safetensors::serialize_to_file(tensors, None, &dir.path().join("model.safetensors")).unwrap();
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    config["num_hidden_layers"] = json!(LAYER_SOURCES.len());
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        if src.join(file).exists() {
            std::fs::copy(src.join(file), dir.path().join(file)).unwrap();
        }
    }
    dir
}

/// Mixed lengths, sent as three concurrent requests so that batches mix them.
fn requests() -> Vec<Vec<Vec<u32>>> {
    let seq = |seed: u32, len: u32| -> Vec<u32> {
        (0..len)
            .map(|i| (seed * 7919 + i * 104_729) % 2000)
            .collect()
    };
    vec![
        vec![seq(1, 37), seq(2, 5), seq(3, 64)],
        vec![seq(4, 3), seq(5, 120)],
        vec![seq(6, 17), seq(7, 9), seq(8, 31), seq(9, 4)],
    ]
}

/// What a server answers to [`requests`] on `/score` (logprobs and top-3) and, with a
/// reference, on `/kld`: the `sequences` arrays (usage timings left out).
async fn answers(model: &Path, reference: Option<&Path>, flags: &[&str]) -> Vec<Value> {
    let mut args = vec!["--max-batch-tokens", "512", "--max-input-tokens", "256"];
    args.extend_from_slice(flags);
    let reference_arg;
    if let Some(r) = reference {
        reference_arg = r.to_str().unwrap().to_string();
        args.extend(["--reference-model", reference_arg.as_str()]);
    }
    let server = common::start_dir(model, &args).await;
    let client = reqwest::Client::new();
    let post = |route: &'static str, body: Value| {
        let (client, base) = (client.clone(), server.base.clone());
        async move {
            let res = client
                .post(format!("{base}{route}"))
                .json(&body)
                .send()
                .await
                .unwrap();
            let status = res.status();
            let text = res.text().await.unwrap();
            assert_eq!(status, 200, "{route} with {flags:?}: {text}");
            serde_json::from_str::<Value>(&text).unwrap()["sequences"].clone()
        }
    };
    let mut routes = vec![("/score", 3)];
    if reference.is_some() {
        routes.push(("/kld", 0));
    }
    let mut out = Vec::new();
    for (route, top_k) in routes {
        let calls = requests().into_iter().map(|tokens| {
            let body = if top_k > 0 {
                json!({ "tokens": tokens, "top_k": top_k })
            } else {
                json!({ "tokens": tokens })
            };
            post(route, body)
        });
        out.extend(futures_util::future::join_all(calls).await);
    }
    let _ = server.stop.send(());
    server.done.await.unwrap().unwrap();
    out
}

/// 2 stages; 3 stages (an explicit split, micro-batches of 3, the reference in 3 stages too);
/// 2 replicas; 2 replicas × 2 stages with micro-batches of 1 (the reference in 2 replicas).
const LAYOUTS: [&[&str]; 4] = [
    &["--device", "cpu,cpu"],
    &[
        "--device",
        "cpu,cpu,cpu",
        "--layer-split",
        "1,2,1",
        "--micro-batch-sequences",
        "3",
        "--reference-device",
        "cpu,cpu,cpu",
    ],
    &["--device", "cpu,cpu", "--replicas", "2"],
    &[
        "--device",
        "cpu,cpu,cpu,cpu",
        "--replicas",
        "2",
        "--micro-batch-sequences",
        "1",
    ],
];

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stages_and_replicas_give_the_bits_of_one_device_for_every_format() {
    let reference = four_layer_copy(REFERENCE);
    for variant in FORMATS {
        let model = four_layer_copy(variant);
        let one_device = answers(model.path(), Some(reference.path()), &[]).await;
        assert_eq!(one_device.len(), 6);
        for layout in LAYOUTS {
            let split = answers(model.path(), Some(reference.path()), layout).await;
            assert!(
                split == one_device,
                "{variant} with {layout:?} differs from one device"
            );
        }
    }
}

/// `/info` shows where the layers are, per replica and stage, for the model and the reference.
#[tokio::test]
async fn info_shows_the_placement() {
    let model = four_layer_copy("llama-w4a16-g128");
    let reference = four_layer_copy(REFERENCE);
    let server = common::start_dir(
        model.path(),
        &[
            "--device",
            "cpu,cpu,cpu,cpu",
            "--replicas",
            "2",
            "--layer-split",
            "3,1",
            "--reference-model",
            reference.path().to_str().unwrap(),
            "--reference-device",
            "cpu,cpu,cpu,cpu",
        ],
    )
    .await;
    let info = common::info(&server.base).await;
    assert_eq!(info.placement.len(), 2);
    for (r, replica) in info.placement.iter().enumerate() {
        assert_eq!(replica.replica, r);
        let stages: Vec<(usize, usize)> = replica
            .stages
            .iter()
            .map(|s| (s.first_layer, s.layers))
            .collect();
        assert_eq!(stages, [(0, 3), (3, 1)]);
        // The first stage holds the embedding, the last the head: each more than a layer.
        assert!(replica.stages.iter().all(|s| s.weight_bytes > 0));
        assert!(replica
            .stages
            .iter()
            .all(|s| s.expected_peak_bytes > s.weight_bytes));
    }
    let reference_placement = &info.reference.unwrap().placement;
    assert_eq!(reference_placement.len(), 2);
    // Two stages of a 4-layer reference, balanced: the last one also holds the head and the
    // scoring's logits, so it gets no more layers than the first.
    let layers: Vec<usize> = reference_placement[0]
        .stages
        .iter()
        .map(|s| s.layers)
        .collect();
    assert_eq!(layers.iter().sum::<usize>(), 4);
    assert!(layers.len() == 2 && layers[1] <= layers[0], "{layers:?}");
    let _ = server.stop.send(());
    server.done.await.unwrap().unwrap();
}

/// A split that does not match the model is refused at start-up, naming the counts.
#[tokio::test]
async fn a_wrong_layer_split_fails_the_start() {
    let model = four_layer_copy("llama-w4a16-g128");
    let args = clap::Parser::try_parse_from([
        "exactscore-server",
        "--model",
        model.path().to_str().unwrap(),
        "--device",
        "cpu,cpu",
        "--layer-split",
        "1,2",
    ])
    .unwrap();
    let config = exactscore_server::config::Config::from_args(args).unwrap();
    let err = exactscore_server::app::Server::load(&config)
        .await
        .err()
        .expect("a 3-layer split of a 4-layer model must fail")
        .to_string();
    assert!(
        err.contains("sums to 3") && err.contains("4 decoder layers"),
        "{err}"
    );
}
