//! Which attention kernel a model runs: `auto` (the default) resolves to the materialized path
//! where the fused kernel does not exist (the CPU, f32), and asking for `flash` there fails at
//! load with the field and the reason instead of falling back silently.

mod common;

use candle_core::DType;
use common::*;
use exactscore_server::model::{AttentionKernel, Model, ModelOptions};
use exactscore_server::quant::ActivationQuantMode;

fn load_with(dtype: DType, attention: AttentionKernel) -> Result<Model, String> {
    let opts = ModelOptions {
        attention,
        ..options(dtype, ActivationQuantMode::Emulate)
    };
    Model::load(&fixtures().join("llama-w4a16-g128"), &opts).map_err(|e| e.to_string())
}

#[test]
fn auto_is_the_default_and_resolves_to_materialized_on_the_cpu() {
    assert_eq!(AttentionKernel::default(), AttentionKernel::Auto);
    for dtype in [DType::F32, DType::BF16] {
        let model = load_with(dtype, AttentionKernel::Auto).unwrap();
        assert_eq!(model.options().attention, AttentionKernel::Materialized);
    }
}

#[test]
fn flash_is_refused_on_the_cpu_naming_the_field() {
    let err = match load_with(DType::BF16, AttentionKernel::Flash) {
        Ok(_) => panic!("flash attention loaded on the CPU"),
        Err(e) => e,
    };
    assert!(err.contains("attention"), "{err}");
    assert!(err.contains("CUDA device"), "{err}");
}

/// gpt-oss's sinks have no flash path: asking for it names the reason, not the device.
#[test]
fn flash_is_refused_for_attention_sinks() {
    let opts = ModelOptions {
        attention: AttentionKernel::Flash,
        ..options(DType::BF16, ActivationQuantMode::Emulate)
    };
    let err = match Model::load(&fixtures().join("gpt_oss-dense-bf16"), &opts) {
        Ok(_) => panic!("flash attention loaded with sinks"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("attention") && err.contains("sinks"), "{err}");
}
