//! A malformed checkpoint fails at load with an error that names the tensor or field.

mod common;

use std::path::Path;

use common::*;
use exactscore_server::model::Model;
use safetensors::Dtype;

const BASE: &str = "llama-w4a16-g128";

/// A copy of the base fixture in a temp dir, with `edit` applied to its tensors
/// (name → (dtype, shape, bytes)) and `config_edit` to its config.json.
fn corrupted(
    edit: impl FnOnce(&mut Tensors),
    config_edit: impl FnOnce(&mut serde_json::Value),
) -> tempfile::TempDir {
    edited_copy(BASE, 1, edit, config_edit)
}

fn load_error(dir: &Path) -> String {
    match Model::load(dir, &options(candle_core::DType::F32, Default::default())) {
        Ok(_) => panic!("corrupted checkpoint loaded"),
        Err(e) => e.to_string(),
    }
}

fn assert_mentions(err: &str, parts: &[&str]) {
    for p in parts {
        assert!(err.contains(p), "error `{err}` does not mention `{p}`");
    }
}

const SCALE: &str = "model.layers.1.mlp.down_proj.weight_scale";
const PACKED: &str = "model.layers.0.self_attn.q_proj.weight_packed";

#[test]
fn unmodified_copy_loads() {
    let dir = corrupted(|_| {}, |_| {});
    Model::load(
        dir.path(),
        &options(candle_core::DType::F32, Default::default()),
    )
    .unwrap();
}

#[test]
fn missing_tensor_is_named() {
    let dir = corrupted(|t| drop(t.remove(SCALE)), |_| {});
    assert_mentions(&load_error(dir.path()), &[SCALE, "missing"]);
}

#[test]
fn wrong_dtype_is_named() {
    let dir = corrupted(|t| t.get_mut(PACKED).unwrap().0 = Dtype::F32, |_| {});
    assert_mentions(&load_error(dir.path()), &[PACKED, "F32", "I32"]);
}

#[test]
fn wrong_shape_is_named() {
    let dir = corrupted(|t| t.get_mut(SCALE).unwrap().1 = vec![128, 8], |_| {});
    assert_mentions(&load_error(dir.path()), &[SCALE, "[128, 8]", "[256, 4]"]);
}

#[test]
fn truncated_file_is_named() {
    let dir = corrupted(|_| {}, |_| {});
    let file = dir.path().join("model.safetensors");
    let len = std::fs::metadata(&file).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&file).unwrap();
    f.set_len(len - 1000).unwrap();
    assert_mentions(&load_error(dir.path()), &["model.safetensors", "truncated"]);
}

#[test]
fn unknown_format_is_refused_with_field() {
    let dir = corrupted(
        |_| {},
        |c| c["quantization_config"]["config_groups"]["group_0"]["format"] = "marlin-24".into(),
    );
    assert_mentions(&load_error(dir.path()), &["format", "marlin-24"]);
}

#[test]
fn unsupported_architecture_is_refused() {
    let dir = corrupted(
        |_| {},
        |c| c["architectures"] = serde_json::json!(["GPTNeoXForCausalLM"]),
    );
    assert_mentions(
        &load_error(dir.path()),
        &["architectures", "GPTNeoXForCausalLM"],
    );
}

#[test]
fn g_idx_tensor_is_refused_not_ignored() {
    let name = "model.layers.0.mlp.up_proj.weight_g_idx";
    let dir = corrupted(
        |t| drop(t.insert(name.into(), (Dtype::I32, vec![256], vec![0; 1024]))),
        |_| {},
    );
    assert_mentions(&load_error(dir.path()), &[name, "unexpected"]);
}

// ---- non-finite values (issue 27) --------------------------------------------------------

/// A NaN or an infinity of `dtype`, little-endian (e4m3fn has no infinity: NaN).
fn special_bytes(dtype: Dtype, value: f32) -> Vec<u8> {
    match dtype {
        Dtype::F32 => value.to_le_bytes().to_vec(),
        Dtype::BF16 => half::bf16::from_f32(value).to_le_bytes().to_vec(),
        Dtype::F16 => half::f16::from_f32(value).to_le_bytes().to_vec(),
        Dtype::F8_E4M3 => vec![if value.is_sign_negative() { 0xff } else { 0x7f }],
        other => panic!("no special value for {other:?}"),
    }
}

/// The tensor `name` re-stored as `dtype` (a float tensor of the fixture, converted exactly
/// from bf16), so one corruption can be tried in every dtype a checkpoint may use.
fn restore_as(t: &mut Tensors, name: &str, dtype: Dtype) {
    let (stored, _, bytes) = t.get_mut(name).unwrap();
    assert_eq!(*stored, Dtype::BF16, "{name}");
    let values = bytes
        .chunks_exact(2)
        .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32());
    *bytes = match dtype {
        Dtype::BF16 => return,
        Dtype::F16 => values
            .flat_map(|v| half::f16::from_f32(v).to_le_bytes())
            .collect(),
        Dtype::F32 => values.flat_map(f32::to_le_bytes).collect(),
        other => panic!("{other:?}"),
    };
    *stored = dtype;
}

/// Overwrites elements `elements` of tensor `name` with `value`.
fn poison(t: &mut Tensors, name: &str, elements: std::ops::Range<usize>, value: f32) {
    let (dtype, _, bytes) = t.get_mut(name).unwrap();
    let special = special_bytes(*dtype, value);
    for e in elements {
        let at = e * special.len();
        bytes[at..at + special.len()].copy_from_slice(&special);
    }
}

fn load_error_as(variant: &str, dir: &Path, dtype: candle_core::DType) -> String {
    let _ = variant;
    match Model::load(dir, &options(dtype, Default::default())) {
        Ok(_) => panic!("{variant}: corrupted checkpoint loaded"),
        Err(e) => e.to_string(),
    }
}

/// Each of these loaded before and served `null` for every logprob. Every float tensor kind
/// (norm, embedding, lm_head row, dense weight, int scale, fp8 weight, NVFP4 fp8 scale, global
/// scales), stored in each float dtype it may have, with NaN, inf and -inf, under f32 and bf16
/// compute: refused naming the tensor and the element.
#[test]
fn non_finite_values_are_refused_naming_tensor_and_element() {
    let layer = "model.layers.1";
    // (fixture, tensor, first element, elements, stored dtypes to try)
    let floats = [Dtype::BF16, Dtype::F16, Dtype::F32];
    let cases: Vec<(&str, String, usize, usize, &[Dtype])> = vec![
        (
            "llama-w4a16-g128",
            "model.norm.weight".into(),
            7,
            1,
            &floats,
        ),
        // one whole row of lm_head (row 5 of [2000, 256])
        (
            "llama-w4a16-g128",
            "lm_head.weight".into(),
            5 * 256,
            256,
            &floats,
        ),
        (
            "llama-w4a16-g128",
            "model.embed_tokens.weight".into(),
            3,
            1,
            &floats,
        ),
        (
            "llama-w4a16-g128",
            format!("{layer}.input_layernorm.weight"),
            0,
            1,
            &floats,
        ),
        (
            "llama-w4a16-g128",
            format!("{layer}.mlp.down_proj.weight_scale"),
            9,
            1,
            &floats,
        ),
        (
            "llama-w4a16-asym-g64",
            format!("{layer}.self_attn.k_proj.weight_scale"),
            2,
            1,
            &floats,
        ),
        (
            "llama-dense-bf16",
            format!("{layer}.self_attn.q_proj.weight"),
            100,
            1,
            &floats,
        ),
        (
            "llama-fp8-dynamic",
            format!("{layer}.mlp.up_proj.weight_scale"),
            4,
            1,
            &floats,
        ),
        (
            "llama-fp8-dynamic",
            format!("{layer}.mlp.up_proj.weight"),
            11,
            1,
            &[Dtype::F8_E4M3],
        ),
        (
            "llama-nvfp4a16",
            format!("{layer}.mlp.gate_proj.weight_scale"),
            6,
            1,
            &[Dtype::F8_E4M3],
        ),
        (
            "llama-nvfp4a16",
            format!("{layer}.mlp.gate_proj.weight_global_scale"),
            0,
            1,
            &[Dtype::F32],
        ),
        (
            "llama-nvfp4",
            format!("{layer}.self_attn.o_proj.input_global_scale"),
            0,
            1,
            &[Dtype::F32],
        ),
    ];
    let mut checked = 0;
    for (variant, name, first, count, dtypes) in &cases {
        for &dtype in *dtypes {
            for value in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                let dir = edited_copy(
                    variant,
                    1,
                    |t| {
                        if t[name.as_str()].0 != dtype {
                            restore_as(t, name, dtype);
                        }
                        poison(t, name, *first..first + count, value);
                    },
                    |_| {},
                );
                for compute in [candle_core::DType::F32, candle_core::DType::BF16] {
                    let err = load_error_as(variant, dir.path(), compute);
                    // e4m3fn has no infinity: its only special value is NaN.
                    let shown = match (dtype, value) {
                        (Dtype::F8_E4M3, _) => "NaN".to_string(),
                        (_, v) if v.is_nan() => "NaN".to_string(),
                        (_, v) => format!("{v}"),
                    };
                    assert_mentions(&err, &[name, &shown, "finite"]);
                    checked += 1;
                }
            }
        }
    }
    assert_eq!(checked, 168);
}

/// config.json values outside their domain, each of which loaded before (and served NaN, or
/// failed only at warm-up): refused naming the field. Tried on a v5 config
/// (`rope_parameters`) and a v4 one (`rope_theta` + `rope_scaling`).
#[test]
fn config_values_outside_their_domain_are_refused_naming_the_field() {
    use serde_json::json;
    type Edit = fn(&mut serde_json::Value);
    let v5: Vec<(&str, Edit)> = vec![
        ("rms_norm_eps", |c| c["rms_norm_eps"] = json!(-1.0)),
        ("rms_norm_eps", |c| c["rms_norm_eps"] = json!(0.0)),
        ("rms_norm_eps", |c| c["rms_norm_eps"] = json!(1e300)),
        ("rope_parameters.rope_theta", |c| {
            c["rope_parameters"]["rope_theta"] = json!(0.0)
        }),
        ("rope_parameters.rope_theta", |c| {
            c["rope_parameters"]["rope_theta"] = json!(-10000.0)
        }),
        ("rope_theta", |c| {
            c["rope_parameters"]["rope_theta"] = json!(1e-45)
        }),
        ("rope_parameters.factor", |c| {
            c["rope_parameters"]["factor"] = json!(0.5)
        }),
        ("rope_parameters.high_freq_factor", |c| {
            c["rope_parameters"]["high_freq_factor"] = json!(1.0)
        }),
        ("max_position_embeddings", |c| {
            c["max_position_embeddings"] = json!(0)
        }),
        ("sliding_window", |c| {
            c["architectures"] = json!(["MistralForCausalLM"]);
            c["sliding_window"] = json!(0);
        }),
        ("sliding_window", |c| {
            c["architectures"] = json!(["MistralForCausalLM"]);
            c["sliding_window"] = json!(-4096);
        }),
        ("num_attention_heads", |c| {
            c.as_object_mut().unwrap().remove("head_dim");
            c["num_attention_heads"] = json!(3);
            c["num_key_value_heads"] = json!(1);
        }),
    ];
    let v4: Vec<(&str, Edit)> = vec![
        ("rope_theta", |c| c["rope_theta"] = json!(0.0)),
        ("rope_scaling.low_freq_factor", |c| {
            c["rope_scaling"]["low_freq_factor"] = json!(-1.0)
        }),
        ("rms_norm_eps", |c| c["rms_norm_eps"] = json!(-1.0)),
    ];
    for (variant, cases) in [("llama-w4a16-g128", v5), ("llama-w4a16-asym-g64", v4)] {
        for (field, edit) in cases {
            let dir = edited_copy(variant, 1, |_| {}, edit);
            let err = load_error_as(variant, dir.path(), candle_core::DType::F32);
            assert_mentions(&err, &[&format!("config field `{field}`")]);
        }
    }
}

/// A config that describes fewer layers, no tied head or another architecture than the
/// tensors hold: the tensors it would leave unread are named (before, `num_hidden_layers: 1`
/// served a one-layer model of the two-layer checkpoint). RoPE tables some checkpoints carry
/// are ignored by rule.
#[test]
fn tensors_the_config_leaves_unread_are_refused_by_name() {
    for (variant, shards) in [("llama-w4a16-g128", 1), ("llama-nvfp4", 2)] {
        let dir = edited_copy(
            variant,
            shards,
            |_| {},
            |c| c["num_hidden_layers"] = 1.into(),
        );
        let err = load_error_as(variant, dir.path(), candle_core::DType::F32);
        assert_mentions(
            &err,
            &["tensor `model.layers.1.", "not read", "more unread"],
        );
    }
    // A third layer's weight next to a two-layer config.
    let extra = "model.layers.2.mlp.gate_proj.weight";
    let dir = edited_copy(
        "llama-dense-bf16",
        1,
        |t| {
            let copy = t["model.layers.1.mlp.gate_proj.weight"].clone();
            t.insert(extra.into(), copy);
        },
        |_| {},
    );
    let err = load_error_as("dense", dir.path(), candle_core::DType::F32);
    assert_mentions(&err, &[extra, "not read"]);
    // A tied config over a checkpoint with its own lm_head reads that head: loads.
    let dir = edited_copy(BASE, 1, |_| {}, |c| c["tie_word_embeddings"] = true.into());
    Model::load(
        dir.path(),
        &options(candle_core::DType::F32, Default::default()),
    )
    .unwrap();
    // Stored RoPE frequencies are recomputed from config.json: ignored, by rule.
    let dir = edited_copy(
        BASE,
        1,
        |t| {
            let inv_freq = (Dtype::F32, vec![32], vec![0u8; 128]);
            t.insert(
                "model.layers.0.self_attn.rotary_emb.inv_freq".into(),
                inv_freq,
            );
        },
        |_| {},
    );
    Model::load(
        dir.path(),
        &options(candle_core::DType::F32, Default::default()),
    )
    .unwrap();
}

/// A checkpoint that is finite but overflows in the forward pass (two lm_head rows of ±3e38,
/// bf16's largest values: their logits leave f32's range) passes the load's scan; the warm-up
/// batch then finds its non-finite logits and the server does not start.
#[tokio::test]
async fn logits_that_overflow_fail_the_warm_up() {
    use exactscore_server::app::Server;
    use exactscore_server::config::{Args, Config};
    let dir = corrupted(
        |t| {
            let (_, _, bytes) = t.get_mut("lm_head.weight").unwrap();
            for (row, value) in [(10, 3e38f32), (11, -3e38)] {
                let v = half::bf16::from_f32(value).to_le_bytes();
                for e in row * 256..(row + 1) * 256 {
                    bytes[2 * e..2 * e + 2].copy_from_slice(&v);
                }
            }
        },
        |_| {},
    );
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixtures().join(BASE).join(file), dir.path().join(file)).unwrap();
    }
    let model = dir.path().to_str().unwrap();
    let args = <Args as clap::Parser>::try_parse_from(["exactscore-server", "--model", model]);
    let config = Config::from_args(args.unwrap()).unwrap();
    let server = Server::load(&config)
        .await
        .expect("a finite checkpoint loads");
    let err = server.warm_up().await.unwrap_err().to_string();
    assert_mentions(&err, &["warm-up", "not finite", "position 0"]);
}

/// A missing or broken reference model is named as the reference, not as the served model.
#[tokio::test]
async fn a_missing_reference_directory_is_named_as_the_reference() {
    use exactscore_server::app::Server;
    use exactscore_server::config::{Args, Config};
    let missing = tempfile::tempdir()
        .unwrap()
        .path()
        .join("no-such-reference");
    let model = fixtures().join(BASE);
    let args = <Args as clap::Parser>::try_parse_from([
        "exactscore-server",
        "--model",
        model.to_str().unwrap(),
        "--reference-model",
        missing.to_str().unwrap(),
    ]);
    let config = Config::from_args(args.unwrap()).unwrap();
    let err = Server::load(&config)
        .await
        .err()
        .expect("no reference to load");
    let message = err.to_string();
    assert_mentions(
        &message,
        &["loading the reference model", "no-such-reference"],
    );
    assert!(!message.starts_with("loading the model"), "{message}");
}

/// `--model` paths that are no checkpoint directory say what they are and what to pass.
#[test]
fn paths_that_are_not_checkpoints_say_what_they_are_and_what_to_do() {
    use exactscore_server::checkpoint::check_model_dir;
    let tmp = tempfile::tempdir().unwrap();
    let gguf = tmp.path().join("model.bin");
    std::fs::write(&gguf, b"GGUF\x03\x00\x00\x00").unwrap();
    let file = tmp.path().join("weights.safetensors");
    std::fs::write(&file, b"{}").unwrap();
    let cache = tmp.path().join("models--org--name");
    std::fs::create_dir_all(cache.join("snapshots/0123abcd")).unwrap();
    let empty = tmp.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let hub_id = std::path::PathBuf::from("some-org/Some-Model-8B");
    for (path, needles) in [
        (
            &gguf,
            &["GGUF file", "huggingface-cli download", "--model DIR"][..],
        ),
        (&file, &["a file, not a directory", "config.json"][..]),
        (
            &hub_id,
            &["hub id", "huggingface-cli download some-org/Some-Model-8B"][..],
        ),
        (
            &cache,
            &["cache folder", "snapshots/<revision>", "0123abcd"][..],
        ),
        (&empty, &["no config.json"][..]),
    ] {
        let err = check_model_dir(path).unwrap_err().to_string();
        assert_mentions(&err, needles);
    }
    check_model_dir(&fixtures().join(BASE)).unwrap();
}

/// Quantization methods that are not read name themselves, what is read and what to do.
#[test]
fn other_quantization_methods_say_what_to_do() {
    use exactscore_server::quant::QuantizationConfig;
    for method in ["bitsandbytes", "hqq"] {
        let raw = serde_json::json!({"quant_method": method, "bits": 4});
        let err = QuantizationConfig::parse(&raw)
            .err()
            .expect("refused")
            .to_string();
        assert_mentions(
            &err,
            &[
                &format!("\"{method}\" is not supported"),
                "llm-compressor",
                "compressed-tensors",
                "quantization_config.quant_method",
            ],
        );
    }
}

// ---- other formats (issue 35): mislabelled or malformed, named at start-up -----------------

type ConfigEdit = fn(&mut serde_json::Value);
type TensorEdit = fn(&mut Tensors);

/// `(fixture, what, tensor edit, config edit, what the error must say)`.
type Malformed = (
    &'static str,
    &'static str,
    TensorEdit,
    ConfigEdit,
    &'static [&'static str],
);

const GPTQ4: &str = "llama-gptq-int4-g128";
const GPTQ3: &str = "llama-gptq-v2-int3-actorder-asym";
const MXFP4: &str = "llama-mxfp4a16";
const CT_ACT: &str = "llama-w4a16-actorder-g64";
const Q_PROJ: &str = "model.layers.0.self_attn.q_proj";
const AWQ: &str = "llama-awq-int4-g64";
const AUTOROUND: &str = "llama-autoround-int4-g64-sym";
const AUTOROUND_AWQ: &str = "llama-autoround-awq-int4-g64";
const FP8: &str = "llama-fp8-block";
const W8A8: &str = "llama-w8a8-int8";
const MODELOPT: &str = "llama-modelopt-nvfp4";
const MODELOPT_FP8: &str = "llama-modelopt-fp8";
const MODELOPT_MIXED: &str = "llama-modelopt-mixed";
const KV_HEAD: &str = "llama-kv-fp8-head";

fn malformed_checkpoints() -> Vec<Malformed> {
    use serde_json::json;
    vec![
        (
            GPTQ4,
            "wrong bits",
            |_| {},
            |c| c["quantization_config"]["bits"] = json!(8),
            &[
                "model.layers.0.self_attn.q_proj.qweight",
                "[32, 256]",
                "[64, 256]",
            ],
        ),
        (
            GPTQ4,
            "bits the format lacks",
            |_| {},
            |c| c["quantization_config"]["bits"] = json!(5),
            &["config field `quantization_config.bits`", "5"],
        ),
        (
            GPTQ4,
            "group size the shapes do not match",
            |_| {},
            |c| c["quantization_config"]["group_size"] = json!(64),
            &[
                "model.layers.0.self_attn.q_proj.qzeros",
                "[2, 32]",
                "[4, 32]",
            ],
        ),
        (
            GPTQ4,
            "group size that does not divide",
            |_| {},
            |c| c["quantization_config"]["group_size"] = json!(96),
            &[
                "layer `model.layers.0.self_attn.q_proj`",
                "group_size",
                "96",
            ],
        ),
        (
            GPTQ3,
            "act-order without g_idx",
            |t| drop(t.remove("model.layers.0.self_attn.q_proj.g_idx")),
            |_| {},
            &["tensor `model.layers.0.self_attn.q_proj.g_idx` is missing"],
        ),
        (
            GPTQ3,
            "g_idx beside desc_act: false",
            |_| {},
            |c| c["quantization_config"]["desc_act"] = json!(false),
            &["tensor `model.layers.0.self_attn.q_proj.g_idx`", "desc_act"],
        ),
        (
            GPTQ3,
            "g_idx outside the groups",
            |t| {
                let bytes = &mut t
                    .get_mut("model.layers.0.self_attn.q_proj.g_idx")
                    .unwrap()
                    .2;
                bytes[..4].copy_from_slice(&7i32.to_le_bytes());
            },
            |_| {},
            &[
                "tensor `model.layers.0.self_attn.q_proj.g_idx`",
                "input 0 is in group 7",
            ],
        ),
        (
            GPTQ3,
            "asymmetric zero points labelled sym",
            |_| {},
            |c| c["quantization_config"]["sym"] = json!(true),
            &[
                "tensor `model.layers.0.self_attn.q_proj.qzeros`",
                "sym: true",
            ],
        ),
        (
            GPTQ4,
            "unknown checkpoint format",
            |_| {},
            |c| {
                c["quantization_config"]["checkpoint_format"] = json!("marlin");
                c["quantization_config"]["format"] = json!("marlin");
            },
            &[
                "config field `quantization_config.checkpoint_format`",
                "marlin",
            ],
        ),
        (
            GPTQ4,
            "a dynamic exclusion of Linears that are quantized",
            |_| {},
            |c| c["quantization_config"]["dynamic"] = json!({"-:.*down_proj": {}}),
            &["model.layers.0.mlp.down_proj.weight"],
        ),
        (
            GPTQ4,
            "a dynamic override that is not implemented",
            |_| {},
            |c| {
                c["quantization_config"]["dynamic"] = json!({"+:.*q_proj": {"pack_dtype": "int16"}})
            },
            &[
                "config field `quantization_config.dynamic.+:.*q_proj.pack_dtype`",
                "int16",
            ],
        ),
        (
            GPTQ4,
            "a dynamic pattern that is not a regex",
            |_| {},
            |c| c["quantization_config"]["dynamic"] = json!({"+:model.layers.(": {"bits": 8}}),
            &[
                "config field `quantization_config.dynamic.+:model.layers.(`",
                "bad pattern",
            ],
        ),
        (
            GPTQ4,
            "a dynamic width the tensors do not have",
            |_| {},
            |c| c["quantization_config"]["dynamic"] = json!({"+:.*\\.1\\..*": {"bits": 8}}),
            &["tensor `model.layers.1.self_attn.q_proj.qweight`"],
        ),
        (
            GPTQ4,
            "a pack dtype other than int32",
            |_| {},
            |c| c["quantization_config"]["pack_dtype"] = json!("int16"),
            &["config field `quantization_config.pack_dtype`"],
        ),
        (
            GPTQ4,
            "qweight of another dtype",
            |t| {
                t.get_mut("model.layers.0.self_attn.q_proj.qweight")
                    .unwrap()
                    .0 = Dtype::U32
            },
            |_| {},
            &["tensor `model.layers.0.self_attn.q_proj.qweight`", "U32"],
        ),
        (
            GPTQ4,
            "a dense weight beside qweight",
            |t| {
                t.insert(
                    format!("{Q_PROJ}.weight"),
                    (Dtype::BF16, vec![256, 256], vec![0; 131072]),
                );
            },
            |_| {},
            &[
                "tensor `model.layers.0.self_attn.q_proj.weight`",
                "unexpected",
            ],
        ),
        (
            CT_ACT,
            "actorder group without weight_g_idx",
            |t| drop(t.remove("model.layers.1.mlp.down_proj.weight_g_idx")),
            |_| {},
            &["tensor `model.layers.1.mlp.down_proj.weight_g_idx` is missing"],
        ),
        (
            CT_ACT,
            "weight_g_idx without actorder",
            |_| {},
            |c| {
                c["quantization_config"]["config_groups"]["group_0"]["weights"]["actorder"] =
                    json!(null)
            },
            &[
                "tensor `model.layers.0.self_attn.q_proj.weight_g_idx`",
                "unexpected",
            ],
        ),
        (
            CT_ACT,
            "weight_g_idx with groups of the wrong size",
            |t| {
                // One input moved into input 0's group: one group of 65 inputs, one of 63.
                let bytes = &mut t
                    .get_mut("model.layers.0.self_attn.q_proj.weight_g_idx")
                    .unwrap()
                    .2;
                let first = bytes[..4].to_vec();
                let other = (1..bytes.len() / 4)
                    .find(|k| bytes[4 * k..4 * k + 4] != first[..])
                    .unwrap();
                bytes[4 * other..4 * other + 4].copy_from_slice(&first);
            },
            |_| {},
            &[
                "tensor `model.layers.0.self_attn.q_proj.weight_g_idx`",
                "not group_size 64",
            ],
        ),
        (
            MXFP4,
            "a UE8M0 NaN scale",
            |t| {
                t.get_mut("model.layers.1.mlp.up_proj.weight_scale")
                    .unwrap()
                    .2[5] = 255;
            },
            |_| {},
            &[
                "tensor `model.layers.1.mlp.up_proj.weight_scale`",
                "element 5",
                "NaN",
            ],
        ),
        (
            MXFP4,
            "group size 16",
            |_| {},
            |c| {
                c["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] =
                    json!(16)
            },
            &[
                "quantization field `config_groups.group_0.weights`",
                "group_size 32",
            ],
        ),
        (
            MXFP4,
            "scales of another shape",
            |t| {
                t.get_mut("model.layers.0.mlp.down_proj.weight_scale")
                    .unwrap()
                    .1 = vec![512, 8];
            },
            |_| {},
            &[
                "tensor `model.layers.0.mlp.down_proj.weight_scale`",
                "[512, 8]",
            ],
        ),
        (
            MXFP4,
            "activation quantization not implemented",
            |_| {},
            |c| {
                c["quantization_config"]["config_groups"]["group_0"]["input_activations"] = json!(
                    {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32,
                     "dynamic": true, "symmetric": true});
            },
            &["quantization field `config_groups.group_0.input_activations`"],
        ),
        (
            AUTOROUND,
            "an AutoRound packing that is not read",
            |_| {},
            |c| c["quantization_config"]["packing_format"] = json!("auto_round:gptqmodel"),
            &[
                "config field `quantization_config.packing_format`",
                "auto_round:gptqmodel",
            ],
        ),
        (
            AUTOROUND,
            "an AutoRound data type other than int",
            |_| {},
            |c| c["quantization_config"]["data_type"] = json!("nv_fp"),
            &["config field `quantization_config.data_type`", "nv_fp"],
        ),
        (
            AUTOROUND,
            "AutoRound activation quantization",
            |_| {},
            |c| c["quantization_config"]["act_bits"] = json!(8),
            &["config field `quantization_config.act_bits`", "8"],
        ),
        (
            AUTOROUND,
            "an extra_config entry of a width GPTQ does not pack",
            |_| {},
            |c| {
                c["quantization_config"]["extra_config"] =
                    json!({"model.layers.1.mlp.up_proj": {"bits": 5}});
            },
            &[
                "config field `quantization_config.extra_config.model.layers.1.mlp.up_proj.bits`",
                "5",
            ],
        ),
        (
            AUTOROUND,
            "an extra_config entry that leaves a quantized Linear in 16 bits",
            |_| {},
            |c| {
                c["quantization_config"]["extra_config"] =
                    json!({"model.layers.1.mlp.up_proj": {"bits": 16}});
            },
            &["model.layers.1.mlp.up_proj.weight"],
        ),
        (
            AUTOROUND,
            "an extra_config group size the tensors do not have",
            |_| {},
            |c| {
                c["quantization_config"]["extra_config"] =
                    json!({"model.layers.1.mlp.up_proj": {"group_size": 128}});
            },
            &[
                "tensor `model.layers.1.mlp.up_proj.qzeros`",
                "[2, 32]",
                "[1, 32]",
            ],
        ),
        (
            AUTOROUND_AWQ,
            "sym: true over AWQ zero points that are not the midpoint",
            |_| {},
            |c| c["quantization_config"]["sym"] = json!(true),
            &[
                "tensor `model.layers.0.self_attn.q_proj.qzeros`",
                "sym: true",
                "midpoint 8",
            ],
        ),
        (
            AWQ,
            "bits other than 4",
            |_| {},
            |c| c["quantization_config"]["bits"] = json!(8),
            &["config field `quantization_config.bits`", "8"],
        ),
        (
            AWQ,
            "group size the shapes do not match",
            |_| {},
            |c| c["quantization_config"]["group_size"] = json!(128),
            &[
                "tensor `model.layers.0.self_attn.q_proj.qzeros`",
                "[2, 16]",
                "[1, 16]",
            ],
        ),
        (
            AWQ,
            "group size that does not divide",
            |_| {},
            |c| c["quantization_config"]["group_size"] = json!(96),
            &[
                "layer `model.layers.0.self_attn.q_proj`",
                "group_size",
                "96",
            ],
        ),
        (
            AWQ,
            "the GEMV layout",
            |_| {},
            |c| c["quantization_config"]["version"] = json!("gemv"),
            &["config field `quantization_config.version`", "gemv"],
        ),
        (
            AWQ,
            "the Marlin layout",
            |_| {},
            |c| c["quantization_config"]["version"] = json!("marlin"),
            &["config field `quantization_config.version`", "marlin"],
        ),
        (
            AWQ,
            "an unknown layout",
            |_| {},
            |c| c["quantization_config"]["format"] = json!("gemm_v3"),
            &["config field `quantization_config.format`", "gemm_v3"],
        ),
        (
            AWQ,
            "no zero points",
            |_| {},
            |c| c["quantization_config"]["zero_point"] = json!(false),
            &["config field `quantization_config.zero_point`"],
        ),
        (
            AWQ,
            "act-order",
            |_| {},
            |c| c["quantization_config"]["desc_act"] = json!(true),
            &["config field `quantization_config.desc_act`"],
        ),
        (
            AWQ,
            "qweight of GPTQ's shape",
            |t| {
                t.get_mut("model.layers.1.mlp.down_proj.qweight").unwrap().1 = vec![32, 128];
            },
            |_| {},
            &[
                "tensor `model.layers.1.mlp.down_proj.qweight`",
                "[32, 128]",
                "[256, 16]",
            ],
        ),
        (
            AWQ,
            "scales missing",
            |t| drop(t.remove("model.layers.0.mlp.gate_proj.scales")),
            |_| {},
            &["tensor `model.layers.0.mlp.gate_proj.scales` is missing"],
        ),
        (
            AWQ,
            "a quantized module listed as not converted",
            |_| {},
            |c| c["quantization_config"]["modules_to_not_convert"] = json!(["k_proj"]),
            &["tensor `model.layers.0.self_attn.k_proj.weight` is missing"],
        ),
        (
            AWQ,
            "a g_idx beside the AWQ tensors",
            |t| {
                t.insert(
                    format!("{Q_PROJ}.g_idx"),
                    (Dtype::I32, vec![128], vec![0; 512]),
                );
            },
            |_| {},
            &[
                "tensor `model.layers.0.self_attn.q_proj.g_idx`",
                "unexpected",
            ],
        ),
        (
            FP8,
            "blocks the scales do not match",
            |_| {},
            |c| c["quantization_config"]["weight_block_size"] = json!([64, 64]),
            &[
                "tensor `model.layers.0.self_attn.q_proj.weight_scale_inv`",
                "[1, 1]",
                "[2, 2]",
            ],
        ),
        (
            FP8,
            "a block size that is not two dimensions",
            |_| {},
            |c| c["quantization_config"]["weight_block_size"] = json!([128]),
            &["config field `quantization_config.weight_block_size`"],
        ),
        (
            FP8,
            "per-tensor scales (dynamic activations per batch)",
            |_| {},
            |c| c["quantization_config"]["weight_block_size"] = json!(null),
            &[
                "config field `quantization_config.weight_block_size`",
                "per batch",
            ],
        ),
        (
            FP8,
            "scales transposed",
            |t| {
                t.get_mut("model.layers.1.mlp.up_proj.weight_scale_inv")
                    .unwrap()
                    .1 = vec![1, 2];
            },
            |_| {},
            &[
                "tensor `model.layers.1.mlp.up_proj.weight_scale_inv`",
                "[1, 2]",
                "[2, 1]",
            ],
        ),
        (
            FP8,
            "static activation scales",
            |_| {},
            |c| c["quantization_config"]["activation_scheme"] = json!("static"),
            &[
                "config field `quantization_config.activation_scheme`",
                "static",
            ],
        ),
        (
            FP8,
            "ue8m0 declared over scales that are not powers of two",
            |_| {},
            |c| c["quantization_config"]["scale_fmt"] = json!("ue8m0"),
            &[
                "tensor `model.layers.0.self_attn.q_proj.weight_scale_inv`",
                "scale_fmt: ue8m0",
                "not a power of two",
            ],
        ),
        (
            FP8,
            "a scale format that is neither float nor ue8m0",
            |_| {},
            |c| c["quantization_config"]["scale_fmt"] = json!("e5m2"),
            &["config field `quantization_config.scale_fmt`", "e5m2"],
        ),
        (
            FP8,
            "e5m2 weights",
            |_| {},
            |c| c["quantization_config"]["fmt"] = json!("e5m2"),
            &["config field `quantization_config.fmt`", "e5m2"],
        ),
        (
            FP8,
            "FP8 embeddings",
            |_| {},
            |c| c["quantization_config"]["modules_to_convert"] = json!(["embed_tokens"]),
            &["config field `quantization_config.modules_to_convert`"],
        ),
        (
            FP8,
            "weights stored as int8",
            |t| {
                t.get_mut("model.layers.0.self_attn.q_proj.weight")
                    .unwrap()
                    .0 = Dtype::I8
            },
            |_| {},
            &[
                "tensor `model.layers.0.self_attn.q_proj.weight`",
                "I8",
                "F8_E4M3",
            ],
        ),
        (
            FP8,
            "an FP8 weight without its scales",
            |t| drop(t.remove("model.layers.0.mlp.down_proj.weight_scale_inv")),
            |_| {},
            &["tensor `model.layers.0.mlp.down_proj.weight`", "F8_E4M3"],
        ),
        (
            FP8,
            "an FP8 module listed as not converted",
            |_| {},
            |c| c["quantization_config"]["modules_to_not_convert"] = json!(["lm_head", "o_proj"]),
            &["tensor `model.layers.0.self_attn.o_proj.weight`", "F8_E4M3"],
        ),
        (
            W8A8,
            "weights labelled 4 bits",
            |_| {},
            |c| {
                c["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] =
                    json!(4)
            },
            &[
                "tensor `model.layers.0.self_attn.q_proj.weight`",
                "4-bit range [-8, 7]",
            ],
        ),
        (
            W8A8,
            "channel scales read as groups of 64",
            |_| {},
            |c| {
                let w = &mut c["quantization_config"]["config_groups"]["group_0"]["weights"];
                w["strategy"] = json!("group");
                w["group_size"] = json!(64);
            },
            &[
                "tensor `model.layers.0.self_attn.q_proj.weight_scale`",
                "[128, 1]",
                "[128, 2]",
            ],
        ),
        (
            W8A8,
            "asymmetric int8 activations",
            |_| {},
            |c| {
                c["quantization_config"]["config_groups"]["group_0"]["input_activations"]
                    ["symmetric"] = json!(false)
            },
            &[
                "config_groups.group_0.input_activations.symmetric",
                "asymmetric",
            ],
        ),
        (
            W8A8,
            "an unknown activation strategy",
            |_| {},
            |c| {
                c["quantization_config"]["config_groups"]["group_0"]["input_activations"]
                    ["strategy"] = json!("batch")
            },
            &["config_groups.group_0.input_activations.strategy", "batch"],
        ),
        (
            W8A8,
            "static int8 activations",
            |_| {},
            |c| {
                let a =
                    &mut c["quantization_config"]["config_groups"]["group_0"]["input_activations"];
                a["strategy"] = json!("tensor");
                a["dynamic"] = json!(false);
            },
            &["config_groups.group_0.input_activations", "Tensor"],
        ),
        (
            W8A8,
            "int8 weights stored as int32",
            |t| {
                let w = t.get_mut("model.layers.0.mlp.up_proj.weight").unwrap();
                w.0 = Dtype::I32;
                w.1 = vec![256, 32];
            },
            |_| {},
            &["tensor `model.layers.0.mlp.up_proj.weight`", "I32"],
        ),
        (
            MODELOPT,
            "a group size the format lacks (config.json's spelling)",
            |_| {},
            |c| {
                c["quantization_config"] = json!({"quant_method": "modelopt",
                    "quant_algo": "NVFP4", "group_size": 32, "ignore": ["lm_head"]})
            },
            &["config field `quantization_config.group_size`", "32"],
        ),
        (
            MODELOPT,
            "an FP8 KV cache",
            |_| {},
            |c| {
                c["quantization_config"] = json!({"producer": {"name": "modelopt"},
                    "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8",
                                     "group_size": 16, "exclude_modules": ["lm_head"]}})
            },
            &[
                "quantization_config.quantization.kv_cache_quant_algo",
                "FP8",
            ],
        ),
        (
            MODELOPT_MIXED,
            "a module listed as FP8 that holds NVFP4 codes",
            |_| {},
            |c| {
                c["quantization_config"]["quantized_layers"]["model.layers.0.mlp.down_proj"] =
                    json!({"quant_algo": "FP8"})
            },
            &["model.layers.0.mlp.down_proj.weight"],
        ),
        (
            MODELOPT_MIXED,
            "an unimplemented algorithm among the listed modules",
            |_| {},
            |c| {
                c["quantization_config"]["quantized_layers"]["model.layers.1.mlp.up_proj"] =
                    json!({"quant_algo": "W4A16_NVFP4", "group_size": 16})
            },
            &[
                "quantization_config.quantized_layers.model.layers.1.mlp.up_proj.quant_algo",
                "W4A16_NVFP4",
            ],
        ),
        (
            MODELOPT,
            "another algorithm",
            |_| {},
            |c| {
                c["quantization_config"] =
                    json!({"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"})
            },
            &["config field `quantization_config.quant_algo`", "W4A8_AWQ"],
        ),
        (
            MODELOPT,
            "block scales not per 16 inputs",
            |t| {
                t.get_mut("model.layers.0.self_attn.q_proj.weight_scale")
                    .unwrap()
                    .1 = vec![64, 16];
            },
            |_| {},
            &[
                "tensor `model.layers.0.self_attn.q_proj.weight_scale`",
                "[64, 16]",
                "[128, 8]",
            ],
        ),
        (
            MODELOPT,
            "no weight_scale_2",
            |t| drop(t.remove("model.layers.1.mlp.down_proj.weight_scale_2")),
            |_| {},
            &["model.layers.1.mlp.down_proj.weight_scale_2"],
        ),
        (
            MODELOPT,
            "a zero input_scale",
            |t| {
                let s = t.get_mut("model.layers.0.mlp.up_proj.input_scale").unwrap();
                s.2 = 0f32.to_le_bytes().to_vec();
            },
            |_| {},
            &["model.layers.0.mlp.up_proj.input_scale", "non-zero"],
        ),
        (
            MODELOPT_FP8,
            "per-channel scales under per-tensor FP8",
            |t| {
                let s = t
                    .get_mut("model.layers.0.self_attn.o_proj.weight_scale")
                    .unwrap();
                s.1 = vec![128, 1];
                s.2 = s.2.repeat(128);
            },
            |_| {},
            &[
                "tensor `model.layers.0.self_attn.o_proj.weight_scale`",
                "[128, 1]",
                "[1, 1]",
            ],
        ),
        (
            MODELOPT_FP8,
            "a group size on FP8",
            |_| {},
            |c| c["quantization_config"]["group_size"] = json!(128),
            &["config field `quantization_config.group_size`", "128"],
        ),
        (
            MODELOPT_FP8,
            "NVFP4 codes labelled FP8",
            |t| {
                t.get_mut("model.layers.0.mlp.up_proj.weight").unwrap().0 = Dtype::U8;
            },
            |_| {},
            &[
                "tensor `model.layers.0.mlp.up_proj.weight`",
                "U8",
                "F8_E4M3",
            ],
        ),
        (
            KV_HEAD,
            "a kv_cache_scheme field compressed-tensors does not have",
            |_| {},
            |c| c["quantization_config"]["kv_cache_scheme"]["per_channel"] = json!(true),
            &[
                "quantization_config.kv_cache_scheme",
                "unknown field `per_channel`",
            ],
        ),
        (
            KV_HEAD,
            "an fp4 KV cache",
            |_| {},
            |c| c["quantization_config"]["kv_cache_scheme"]["num_bits"] = json!(4),
            &[
                "quantization_config.kv_cache_scheme.num_bits",
                "4",
                "only 8",
            ],
        ),
        (
            KV_HEAD,
            "an int8 KV cache",
            |_| {},
            |c| c["quantization_config"]["kv_cache_scheme"]["type"] = json!("int"),
            &["quantization_config.kv_cache_scheme.type", "`int`"],
        ),
        (
            KV_HEAD,
            "a per-channel KV cache",
            |_| {},
            |c| c["quantization_config"]["kv_cache_scheme"]["strategy"] = json!("channel"),
            &["quantization_config.kv_cache_scheme.strategy", "`channel`"],
        ),
        (
            KV_HEAD,
            "dynamic KV-cache scales",
            |_| {},
            |c| c["quantization_config"]["kv_cache_scheme"]["dynamic"] = json!(true),
            &["quantization_config.kv_cache_scheme.dynamic", "static"],
        ),
        (
            KV_HEAD,
            "a missing k_scale",
            |t| drop(t.remove("model.layers.1.self_attn.k_scale")),
            |_| {},
            &["tensor `model.layers.1.self_attn.k_scale` is missing"],
        ),
        (
            KV_HEAD,
            "per-tensor scales under attn_head",
            |t| t.get_mut("model.layers.0.self_attn.v_scale").unwrap().1 = vec![2],
            |_| {},
            &["model.layers.0.self_attn.v_scale", "[2]", "[2, 1, 1]"],
        ),
        (
            KV_HEAD,
            "per-head scales under strategy tensor",
            |_| {},
            |c| c["quantization_config"]["kv_cache_scheme"]["strategy"] = json!("tensor"),
            &["model.layers.0.self_attn.k_scale", "[2, 1, 1]", "[1]"],
        ),
        (
            KV_HEAD,
            "a zero KV-cache scale",
            |t| {
                let scale = t.get_mut("model.layers.0.self_attn.k_scale").unwrap();
                scale.2[..2].copy_from_slice(&[0, 0]);
            },
            |_| {},
            &[
                "model.layers.0.self_attn.k_scale",
                "finite and positive",
                "0",
            ],
        ),
    ]
}

#[test]
fn malformed_checkpoints_of_other_formats_are_named_at_load() {
    for (variant, what, edit, config_edit, needles) in malformed_checkpoints() {
        let dir = edited_copy(variant, 1, edit, config_edit);
        let err = load_error_as(variant, dir.path(), candle_core::DType::F32);
        for needle in needles {
            assert!(
                err.contains(needle),
                "{variant}, {what}: `{err}` lacks `{needle}`"
            );
        }
    }
}

#[test]
fn unmodified_copies_of_other_formats_load() {
    for variant in [
        GPTQ4,
        GPTQ3,
        MXFP4,
        CT_ACT,
        AWQ,
        AUTOROUND,
        AUTOROUND_AWQ,
        FP8,
        W8A8,
        MODELOPT,
        MODELOPT_FP8,
        KV_HEAD,
    ] {
        let dir = edited_copy(variant, 2, |_| {}, |_| {});
        Model::load(
            dir.path(),
            &options(candle_core::DType::F32, Default::default()),
        )
        .unwrap_or_else(|e| panic!("{variant}: {e}"));
    }
}

/// W4A8-FP8 (integer weights, fp8 activations): vLLM converts the weights' group scales to fp8
/// for its kernels, which is not emulated: refused under `--activation-quant emulate` naming
/// the layer, the field and the way out; with `off` the stored weights load.
#[test]
fn integer_weights_with_fp8_activations_are_refused_when_emulated() {
    let dir = corrupted(
        |_| {},
        |c| {
            c["quantization_config"]["config_groups"]["group_0"]["input_activations"] = serde_json::json!({
                "num_bits": 8, "type": "float", "strategy": "token", "dynamic": true,
                "symmetric": true});
        },
    );
    let err = load_error(dir.path());
    assert_mentions(
        &err,
        &[
            "model.layers.0.self_attn.q_proj",
            "input_activations",
            "W4A8-FP8",
            "--activation-quant off",
        ],
    );
    Model::load(
        dir.path(),
        &options(
            candle_core::DType::F32,
            exactscore_server::quant::ActivationQuantMode::Off,
        ),
    )
    .unwrap();
}

/// `variant` loaded in f32 on the CPU with `--kv-cache-quant emulate` and `dtype`: its error.
fn kv_load_error(variant: &str, dtype: exactscore_server::quant::KvCacheDtype) -> String {
    let mut opts = options(candle_core::DType::F32, Default::default());
    opts.linear.kv_cache.dtype = dtype;
    match Model::load(&fixtures().join(variant), &opts) {
        Ok(_) => panic!("{variant} loaded with {dtype:?}"),
        Err(e) => e.to_string(),
    }
}

/// KV-cache quantization where vLLM caches something else (MLA's latent, Gemma 4's shared
/// layers, linear attention's state) is refused naming the layer, and the what-if
/// `--kv-cache-dtype fp8_e4m3` on a checkpoint that has a scheme names the flag.
#[test]
fn kv_cache_quantization_is_refused_where_it_does_not_apply() {
    use exactscore_server::quant::KvCacheDtype::Fp8E4m3;
    let err = kv_load_error("deepseek_v2-w4a16-g32", Fp8E4m3);
    assert_mentions(
        &err,
        &["model.layers.0.self_attn", "latent", "--kv-cache-dtype"],
    );
    let err = kv_load_error("qwen3_5-w4a16-g32-linattn", Fp8E4m3);
    assert_mentions(&err, &["linear_attn", "linear-attention"]);
    let err = kv_load_error(KV_HEAD, Fp8E4m3);
    assert_mentions(&err, &["--kv-cache-dtype", "kv_cache_scheme"]);
}

/// gpt-oss's native MXFP4 experts: a malformed `*_blocks` / `*_scales` tensor, or their
/// quantization config on an architecture without them, is refused naming what is wrong.
#[test]
fn malformed_native_mxfp4_experts_are_named() {
    const VARIANT: &str = "gpt_oss-mxfp4";
    const BLOCKS: &str = "model.layers.1.mlp.experts.gate_up_proj_blocks";
    const SCALES: &str = "model.layers.2.mlp.experts.down_proj_scales";
    let error = |edit: &dyn Fn(&mut Tensors), config_edit: &dyn Fn(&mut serde_json::Value)| {
        load_error(edited_copy(VARIANT, 1, edit, config_edit).path())
    };
    let untouched = |_: &mut serde_json::Value| {};
    // [8 experts, 128 rows, 2 groups, 16 bytes] read as 4 groups of 8 bytes
    let err = error(
        &|t| t.get_mut(BLOCKS).unwrap().1 = vec![8, 128, 4, 8],
        &untouched,
    );
    assert_mentions(&err, &[BLOCKS, "[8, 128, 4, 8]", "[8, 128, 2, 16]"]);
    let err = error(&|t| drop(t.remove(SCALES)), &untouched);
    assert_mentions(&err, &[SCALES, "missing"]);
    // UE8M0's NaN in the 5th exponent
    let err = error(&|t| t.get_mut(SCALES).unwrap().2[4] = 255, &untouched);
    assert_mentions(&err, &[SCALES, "element 4", "NaN"]);
    let err = error(&|t| t.get_mut(BLOCKS).unwrap().0 = Dtype::I8, &untouched);
    assert_mentions(&err, &[BLOCKS, "I8", "U8"]);
    // the native tensors without `quant_method: mxfp4`
    let err = error(&|_| {}, &|c| {
        c["quantization_config"] = serde_json::Value::Null
    });
    assert_mentions(&err, &[BLOCKS.replace("1.", "0.").as_str(), "mxfp4"]);
    let err = error(&|_| {}, &|c| {
        c["architectures"] = serde_json::json!(["MixtralForCausalLM"])
    });
    assert_mentions(&err, &["quant_method", "mxfp4", "MixtralForCausalLM"]);
}

/// A log writer that keeps what it is given.
#[derive(Clone, Default)]
struct Captured(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// NVFP4 shards that vLLM fuses with different global scales (k_proj's doubled here): the
/// checkpoint loads, each shard read with its own scale, and a warning names the layers and
/// says what vLLM does instead. The unmodified fixture loads without it.
#[test]
fn nvfp4_fused_shards_with_different_global_scales_are_read_per_layer_and_named() {
    let captured = Captured::default();
    let writer = captured.clone();
    let dispatch = tracing::Dispatch::new(
        tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish(),
    );
    let load = |dir: &Path| {
        tracing::dispatcher::with_default(&dispatch, || {
            Model::load(dir, &options(candle_core::DType::F32, Default::default()))
        })
    };
    let unmodified = edited_copy("llama-nvfp4", 2, |_| {}, |_| {});
    load(unmodified.path()).expect("unmodified copy loads");
    let log = || String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    assert!(!log().contains("different global scales"), "{}", log());
    let k = "model.layers.0.self_attn.k_proj.weight_global_scale";
    let dir = edited_copy(
        "llama-nvfp4",
        2,
        |t| {
            let (_, _, bytes) = t.get_mut(k).unwrap();
            let doubled = 2.0 * f32::from_le_bytes(bytes[..4].try_into().unwrap());
            bytes[..4].copy_from_slice(&doubled.to_le_bytes());
        },
        |_| {},
    );
    let model = load(dir.path()).expect("loads, per layer");
    let log = log();
    assert_mentions(
        &log,
        &[
            "different global scales",
            "model.layers.0.self_attn.q_proj",
            "model.layers.0.self_attn.k_proj",
            "vLLM issue #54150",
        ],
    );
    let linears = model.linears();
    let (_, k_proj) = linears
        .iter()
        .find(|(n, _)| n == "model.layers.0.self_attn.k_proj")
        .unwrap();
    let Some(exactscore_server::ops::Packed::Nvfp4 { per_tensor, .. }) = k_proj.weight().packed()
    else {
        panic!("k_proj: not nvfp4");
    };
    assert_eq!(
        per_tensor,
        exactscore_server::ops::Nvfp4PerTensor::Divides(16064.0)
    );
}
