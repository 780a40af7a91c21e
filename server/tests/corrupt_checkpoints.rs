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
