//! The stored-reference bound (model::stored_kld, docs/stored-reference.md) against the exact
//! divergence of the full rows: it always contains it, over random and adversarial pairs of
//! distributions, and it is attained by the worst tail it assumes.

use exactscore_server::model::stored_kld::{bounded_kld, BoundedKld, StoredRow};
use exactscore_server::ops::{kld_row, reference_row, served_tail_row};
use proptest::prelude::*;

/// The bound of `model`'s divergence from `reference` (both f32 logit rows) when only the
/// reference's top `k` and its tail mass are kept, next to the exact divergence.
fn bound_and_exact(reference: &[f32], model: &[f32], k: usize) -> (BoundedKld, f64) {
    let stored = reference_row(reference, k);
    let row = StoredRow {
        ids: &stored.ids,
        logprobs: &stored.logprobs,
        tail_logmass: stored.tail_logmass,
    };
    let tail = row.tail_set(reference.len());
    let served = served_tail_row(model, &stored.ids, 0, tail.budget());
    (
        bounded_kld(&row, &tail, &served),
        kld_row(reference, model, 0).kld,
    )
}

fn assert_contains(b: &BoundedKld, exact: f64, what: &str) {
    assert!(
        b.lower <= exact && exact <= b.upper,
        "{what}: exact {exact} outside [{}, {}]",
        b.lower,
        b.upper
    );
    // The collapsed tail is the least the tail can be, so the estimate lies between too.
    assert!(
        b.lower <= b.estimate && b.estimate <= b.upper,
        "{what}: {b:?}"
    );
}

/// Logit rows: a spread of scales, so that some rows are peaked and some flat, and a model
/// that is the reference plus noise of its own scale (a quantization) or unrelated.
fn pair(vocab: usize) -> impl Strategy<Value = (Vec<f32>, Vec<f32>)> {
    (
        prop::collection::vec(-1.0f32..1.0, vocab),
        prop::collection::vec(-1.0f32..1.0, vocab),
        0.1f32..30.0,
        0.0f32..2.0,
    )
        .prop_map(|(r, noise, scale, mix)| {
            let reference: Vec<f32> = r.iter().map(|x| x * scale).collect();
            let model = reference
                .iter()
                .zip(&noise)
                .map(|(x, n)| x + mix * scale * n)
                .collect();
            (reference, model)
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn the_bound_contains_the_exact_divergence((reference, model) in pair(48), k in 1usize..=48) {
        let (b, exact) = bound_and_exact(&reference, &model, k);
        assert_contains(&b, exact, &format!("k {k}"));
    }

    /// A flat reference tail (every tail token as likely as the K-th) on the tokens the model
    /// finds least likely: the tail the upper bound assumes, nearly.
    #[test]
    fn an_adversarial_tail_is_contained_and_nearly_attains_the_upper_bound(
        model in prop::collection::vec(-8.0f32..8.0, 40),
        k in 1usize..20,
        tail_tokens in 1usize..20,
        tail_logit in -12.0f32..0.0,
        at_cap in any::<bool>(),
    ) {
        let mut order: Vec<usize> = (0..model.len()).collect();
        order.sort_by(|&a, &b| model[a].total_cmp(&model[b]));
        let mut reference = vec![-200.0f32; model.len()];
        // The top K on the model's likeliest tokens, the tail flat on its least likely.
        for (rank, &i) in order.iter().rev().take(k).enumerate() {
            reference[i] = 5.0 - rank as f32 * 0.1;
        }
        // Just below the K-th stored logit (the cap), or anywhere under it.
        let cap = 5.0 - (k - 1) as f32 * 0.1 - 1e-4;
        for &i in order.iter().take(tail_tokens) {
            reference[i] = if at_cap { cap } else { tail_logit.min(cap) };
        }
        let (b, exact) = bound_and_exact(&reference, &model, k);
        assert_contains(&b, exact, "adversarial");
        // Flat at the cap on the least likely tokens: the worst case, up to the f32 widening,
        // the 1e-4 below the cap and the −200 logits' leftover mass.
        if at_cap {
            prop_assert!(b.upper - exact < 1e-4 * (1.0 + exact.abs()), "{b:?} exact {exact}");
        }
    }
}

#[test]
fn the_whole_vocabulary_stored_leaves_no_gap() {
    let reference = [0.5f32, -1.0, 2.0, 0.25, -3.0, 1.5];
    let model = [0.0f32, -0.5, 2.5, 0.25, -2.0, 1.0];
    let (b, exact) = bound_and_exact(&reference, &model, 6);
    assert_contains(&b, exact, "k = vocab");
    assert!(b.upper - b.lower < 1e-5, "{b:?}");
    assert!(
        (b.estimate - exact).abs() < 1e-6 && b.tail_mass == 0.0,
        "{b:?}"
    );
}

#[test]
fn the_gap_shrinks_as_k_grows() {
    // Zipf-like reference, a perturbed model: the width must fall with K.
    let reference: Vec<f32> = (1..=200).map(|r| -(r as f32).ln() * 1.3).collect();
    let model: Vec<f32> = reference
        .iter()
        .enumerate()
        .map(|(i, x)| x + 0.3 * ((i * 7919 % 13) as f32 / 13.0 - 0.5))
        .collect();
    let widths: Vec<f64> = [8, 32, 64, 128]
        .iter()
        .map(|&k| {
            let (b, exact) = bound_and_exact(&reference, &model, k);
            assert_contains(&b, exact, &format!("k {k}"));
            b.upper - b.lower
        })
        .collect();
    assert!(widths.windows(2).all(|w| w[1] < w[0]), "{widths:?}");
}

/// A tail token the served model gives q = 0 (a −∞ logit): where the budget's caps take the
/// whole mass and nothing rests on it, it adds nothing (0 · ∞ = 0, not NaN); where mass can
/// fall on it, the worst tail is +∞.
#[test]
fn a_zero_probability_tail_token_is_infinite_only_where_mass_can_fall_on_it() {
    use exactscore_server::ops::TailBudget;
    let model = [2.0f32, 1.0, 0.5, f32::NEG_INFINITY];
    // The worst tail of `logits` with token 0 stored, for a tail of `mass` in caps of `cap`.
    let worst = |logits: &[f32], mass: f64, cap: f64| {
        served_tail_row(logits, &[0], 0, TailBudget { mass, cap }).worst_tail
    };
    // Three tail tokens, caps of a third: every token full, nothing rests.
    assert_eq!(worst(&model, 0.3, 0.1), f64::INFINITY);
    // The cap fits the mass exactly once: the −∞ token takes it all, the rest is zero.
    assert_eq!(worst(&model, 0.25, 0.25), f64::INFINITY);
    // Without the −∞ token, rest 0 on the next: a finite number, not NaN.
    let finite = worst(&model[..3], 0.2, 0.1);
    assert!(finite.is_finite(), "{finite}");
    // Every token full with the −∞ one among them, nothing resting on the largest surprise
    // (0 · ∞ gave NaN here).
    assert!(!worst(&model, 0.75, 0.25).is_nan());
}
