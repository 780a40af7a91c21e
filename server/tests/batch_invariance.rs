//! A sequence scores to the same bits whatever shares its batch, on the CPU, for any batch
//! composition: random batches of random sequences, many of them 1 to 3 tokens long (so that a
//! whole batch can hold just one or two tokens), each sequence compared bit for bit with its
//! scores alone.

mod common;

use common::*;
use exactscore_server::model::{Model, SequenceScores};
use exactscore_server::quant::ActivationQuantMode::Emulate;

/// A small deterministic generator (xorshift), so a failure names a reproducible case.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

/// The reproduction: `[1474, 618]` alone (a batch of two tokens) and next to `[1992]`
/// (three) gave -13.269267 and -13.269264.
#[test]
fn two_tokens_alone_and_beside_one_more_are_identical() {
    let model = load("llama-w4a16-g128", Emulate);
    let alone = score_all(&model, &[vec![1474, 618]], 0);
    let shared = score_all(&model, &[vec![1474, 618], vec![1992]], 0);
    assert_eq!(alone[0], shared[0]);
    let one = score_all(&model, &[vec![1992]], 0);
    assert_eq!(one[0], shared[1]);
}

/// `batches` random batches of 1..=8 sequences drawn from a pool in which most sequences have
/// 1 to 3 tokens; every sequence's scores (logprobs, argmax, top-3) bitwise equal to alone.
fn random_compositions(variant: &str, dtype: candle_core::DType, batches: usize, seed: u64) {
    let model = Model::load(&fixtures().join(variant), &options(dtype, Emulate)).unwrap();
    let mut rng = Rng(seed);
    let pool: Vec<Vec<u32>> = (0..24)
        .map(|i| {
            let len = if i < 16 { 1 + i % 3 } else { 4 + rng.below(60) };
            (0..len).map(|_| rng.below(2000) as u32).collect()
        })
        .collect();
    let alone: Vec<SequenceScores> = pool
        .iter()
        .map(|s| score_all(&model, std::slice::from_ref(s), 3).remove(0))
        .collect();
    let mut tokens_per_batch = Vec::new();
    for b in 0..batches {
        let picks: Vec<usize> = (0..1 + rng.below(8))
            .map(|_| rng.below(pool.len()))
            .collect();
        let seqs: Vec<Vec<u32>> = picks.iter().map(|&p| pool[p].clone()).collect();
        tokens_per_batch.push(seqs.iter().map(Vec::len).sum::<usize>());
        for (scores, &p) in score_all(&model, &seqs, 3).iter().zip(&picks) {
            assert_eq!(
                *scores, alone[p],
                "{variant} {dtype:?}: batch {b} {picks:?}: sequence {p} ({:?}) differs from alone",
                pool[p]
            );
        }
    }
    let small = tokens_per_batch.iter().filter(|&&t| t <= 3).count();
    println!(
        "{variant} {dtype:?}: {batches} random batches bitwise equal to alone ({small} of them \
         with 1-3 tokens in total)"
    );
    assert!(small > 0, "no batch of 1-3 tokens was drawn");
}

#[test]
fn random_batch_compositions_are_bitwise_invariant_f32() {
    random_compositions(
        "llama-w4a16-g128",
        candle_core::DType::F32,
        150,
        0x9e37_79b9,
    );
    // Activation QDQ on every Linear input (NVFP4 W4A4), and fp8 weights (with per-token
    // dynamic QDQ)
    random_compositions("llama-nvfp4", candle_core::DType::F32, 40, 7);
    random_compositions("llama-fp8-dynamic", candle_core::DType::F32, 40, 11);
}

#[test]
fn random_batch_compositions_are_bitwise_invariant_bf16() {
    random_compositions("llama-dense-bf16", candle_core::DType::BF16, 40, 3);
}

/// Mixtures of experts: the router's logits go through the row-invariant GEMM like every
/// Linear (with candle's plain matmul a two-token sequence changed in the last bits beside
/// others), and the hybrid models (Gated DeltaNet + gated attention + experts with a shared
/// expert) run their linear-attention ops per sequence, so a sequence's scores do not depend on
/// its batch, in f32 and bf16; DeepSeek-V3's latent attention and f32 group-limited routing
/// too. (80 batches per model and dtype passed once; 12 here.)
#[test]
fn moe_batch_compositions_are_bitwise_invariant() {
    random_compositions("qwen3moe-w4a16-g32", candle_core::DType::F32, 12, 17);
    for (variant, seed) in [
        ("qwen3_5_moe-w4a16-g32", 5),
        ("qwen3_next-fp8-dynamic", 13),
        ("deepseek_v3-fp8-dynamic", 43),
    ] {
        random_compositions(variant, candle_core::DType::F32, 12, seed);
        random_compositions(variant, candle_core::DType::BF16, 12, seed + 1);
    }
}

/// A large batch's mixture runs its tokens in chunks (a budget of routed rows): each chunk's
/// experts get fewer rows, as a smaller batch's do, and every token scores the same bits. Here
/// the budget is forced down to a few tokens per chunk (Gemma 4's routed mixture beside its
/// dense MLP, and Qwen3-MoE's).
#[test]
fn moe_tokens_in_chunks_score_the_same_bits() {
    use exactscore_server::model::blocks::set_routed_row_bytes;
    let seqs: Vec<Vec<u32>> = (0..3)
        .map(|s| (0..40).map(|i| (s * 389 + i * 71) % 2000).collect())
        .collect();
    for variant in ["gemma4_moe-w4a16-g32", "qwen3moe-w4a16-g32"] {
        for dtype in [candle_core::DType::F32, candle_core::DType::BF16] {
            let model = Model::load(&fixtures().join(variant), &options(dtype, Emulate)).unwrap();
            let whole = score_all(&model, &seqs, 3);
            // 7 tokens' routed rows: 120 tokens in 18 chunks
            let config: serde_json::Value = serde_json::from_str(
                &std::fs::read_to_string(fixtures().join(variant).join("config.json")).unwrap(),
            )
            .unwrap();
            let text = config.get("text_config").unwrap_or(&config);
            let hidden = text["hidden_size"].as_u64().unwrap() as usize;
            let k = text
                .get("num_experts_per_tok")
                .or_else(|| text.get("top_k_experts"))
                .and_then(|v| v.as_u64())
                .unwrap() as usize;
            set_routed_row_bytes(7 * k * hidden * dtype.size_in_bytes());
            let chunked = score_all(&model, &seqs, 3);
            set_routed_row_bytes(512 << 20);
            assert_eq!(
                whole, chunked,
                "{variant} {dtype:?}: tokens in chunks changed the scores"
            );
        }
    }
}
