//! The opt-in stage profiler: every stage of the forward pass is recorded the expected number of
//! times, and profiling does not change a single result. (Own test binary: the profiler is
//! process-global.)

mod common;

use common::{load, reference, sequences};
use exactscore_server::model::profile;
use exactscore_server::model::ScoreInput;
use exactscore_server::quant::ActivationQuantMode;

#[test]
fn profiling_records_every_stage_and_changes_nothing() {
    let model = load("llama-w4a16-g128", ActivationQuantMode::Emulate);
    let layers = model.config().num_layers as u64;
    let seqs = sequences(&reference("llama-w4a16-g128"));
    let batch: Vec<ScoreInput> = seqs
        .iter()
        .take(2)
        .map(|s| ScoreInput {
            stored: exactscore_server::model::StoredRequest::NONE,
            tokens: s,
            top_k: 3,
        })
        .collect();
    let plain = model.score(&batch).unwrap();

    profile::set_enabled(true);
    let _ = profile::take();
    let profiled = model.score(&batch).unwrap();
    profile::set_enabled(false);
    let stages = profile::take();

    assert_eq!(plain, profiled, "profiling changed the scores");
    let calls = |name: &str| {
        stages
            .iter()
            .find(|(n, _, _)| *n == name)
            .map(|(_, _, c)| *c)
            .unwrap_or_else(|| panic!("stage {name} missing from {stages:?}"))
    };
    // The MLP runs in row chunks (one here: the batch is shorter than a chunk): gate/up
    // dequantize once, then multiply per chunk; down dequantizes at the first chunk, multiplies
    // per chunk and assembles its output once.
    for (name, per_layer) in [
        ("qkv_proj", 1),
        ("attention", 1),
        ("o_proj", 1),
        ("gate_up_proj", 2),
        ("silu_mul", 1),
        ("down_proj", 3),
    ] {
        assert_eq!(calls(name), per_layer * layers, "{name}");
    }
    // Each norm also adds the residual before it (fused), so there is no separate residual stage.
    assert_eq!(calls("norm"), 2 * layers + 1);
    // Only o_proj's input: the norms and SwiGLU apply the QDQ of the layers they feed (none
    // for this weights-only model).
    assert_eq!(calls("act_qdq"), layers);
    assert_eq!(calls("embed"), 1);
    // The batch layout (positions, sequence starts) of each pipeline stage: one stage here.
    assert_eq!(calls("layout"), 1);
    // The lm_head runs per sequence (in row chunks); both sequences are shorter than a chunk.
    assert_eq!(calls("lm_head"), 2);
    assert_eq!(calls("scoring"), 2);
    assert_eq!(stages.len(), 12, "{stages:?}");
}
