//! `/diff`: where the served model departs from the reference. Both run layer by layer in
//! lockstep on the same tokens, and after every decoder layer the two residual streams are
//! compared at every position: cosine error and SQNR, from sums taken in f64 on the device
//! (only per-position numbers leave it). `reference_until` lets the served model go on from the
//! reference's state, to show where the error enters; module attribution measures the KLD of
//! the reference with one module's weights replaced by the served model's dequantized ones.

use std::collections::BTreeMap;
use std::ops::Range;

use candle_core::{DType, Device, Result, Tensor};

use super::decoder::{split_module_name, Model};
use super::kld::{kld_hidden, logit_chunks, SequenceKld};
use super::profile;
use crate::quant::dense::DenseWeight;
use crate::quant::QuantLinear;

/// SQNRs are reported within ±this many dB: identical states (no noise at all) give +200.
/// f32 states that differ at all differ by at least one rounding step, about 150 dB below
/// their norm, so the cap never hides a real difference.
pub const SQNR_CAP_DB: f64 = 200.0;

/// Rows of the states compared at once (their f32 copies, and on the CPU f64 ones).
const COMPARE_ROWS: usize = 4096;

/// What a `/diff` computes besides the per-layer comparison and the final KLD.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct DiffOptions {
    /// The served model continues from the reference's state after this decoder layer (and
    /// after every one before it). The comparison of a layer is taken before the hand-over, so
    /// for layers up to here it is the error of that layer alone, on the reference's input.
    pub reference_until: Option<usize>,
    /// Modules to attribute, as [`Model::linears`] names them; empty: no attribution.
    pub attribute: Vec<String>,
}

/// One decoder layer's output, compared at every position of a sequence.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LayerError {
    /// `1 − cos(served, reference)`.
    pub cos_error: Vec<f64>,
    /// `10 · log10(|reference|² / |served − reference|²)` in dB, within ±[`SQNR_CAP_DB`].
    pub sqnr_db: Vec<f64>,
}

impl LayerError {
    /// Mean over the positions, summed in f64.
    pub fn mean_cos_error(&self) -> f64 {
        mean(&self.cos_error)
    }

    pub fn mean_sqnr_db(&self) -> f64 {
        mean(&self.sqnr_db)
    }
}

fn mean(values: &[f64]) -> f64 {
    values.iter().sum::<f64>() / values.len().max(1) as f64
}

/// What `/diff` finds for one sequence.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SequenceDiff {
    /// Per decoder layer, in order.
    pub layers: Vec<LayerError>,
    /// The final divergence, as `/kld` computes it.
    pub kld: SequenceKld,
    /// Per module of [`DiffOptions::attribute`], in its order: Σ over the sequence's positions
    /// of KL(reference ‖ reference with that module's weights replaced by the served model's).
    pub modules: Vec<f64>,
}

impl SequenceDiff {
    /// The first position with a NaN or an infinity in the final divergence or in a layer's
    /// comparison. A module's KLD is a sum over the positions, so a non-finite one is reported
    /// at position 0.
    pub fn first_non_finite(&self) -> Option<usize> {
        let in_layers = self.layers.iter().filter_map(|layer| {
            layer
                .cos_error
                .iter()
                .zip(&layer.sqnr_db)
                .position(|(c, s)| !(c.is_finite() && s.is_finite()))
        });
        let in_modules = self.modules.iter().any(|m| !m.is_finite()).then_some(0);
        self.kld
            .first_non_finite()
            .into_iter()
            .chain(in_layers)
            .chain(in_modules)
            .min()
    }
}

/// Why two models cannot be compared layer by layer, if they cannot.
pub fn incompatibility(served: &Model, reference: &Model) -> Option<String> {
    let (a, b) = (served.config(), reference.config());
    if a.num_layers != b.num_layers {
        return Some(format!(
            "the reference has {} decoder layers, the served model {}",
            b.num_layers, a.num_layers
        ));
    }
    if a.hidden_size != b.hidden_size {
        return Some(format!(
            "the reference's hidden size is {}, the served model's {}",
            b.hidden_size, a.hidden_size
        ));
    }
    None
}

/// The served model's modules whose weights differ in format from the reference's (the
/// quantized ones, against an unquantized reference): what attribution can swap.
pub fn attributable_modules(served: &Model, reference: &Model) -> Vec<String> {
    let formats: BTreeMap<String, String> = reference
        .linears()
        .into_iter()
        .map(|(name, l)| (name, l.weight().describe()))
        .collect();
    served
        .linears()
        .into_iter()
        .filter(|(name, l)| formats.get(name) != Some(&l.weight().describe()))
        .map(|(name, _)| name)
        .collect()
}

/// Compares `served` with `reference` after every decoder layer on `sequences`, with the final
/// KLD and, when asked, each module's KLD contribution. Runs on the calling thread, on every
/// device of both models (the hidden states cross as pipeline stages hand them over).
pub fn diff_batch(
    served: &Model,
    reference: &Model,
    sequences: &[&[u32]],
    options: &DiffOptions,
) -> Result<Vec<SequenceDiff>> {
    diff_batch_with(served, reference, sequences, options, &|| Ok(()))
}

/// [`diff_batch`], calling `boundary` before every unit of work: each decoder layer of either
/// model, each chunk of logits, each attributed module and each layer of its run. An error
/// from it stops the comparison there; the engine uses it to stop work nobody waits for and
/// to let other batches use the devices in between.
pub fn diff_batch_with(
    served: &Model,
    reference: &Model,
    sequences: &[&[u32]],
    options: &DiffOptions,
    boundary: &dyn Fn() -> Result<()>,
) -> Result<Vec<SequenceDiff>> {
    if let Some(reason) = incompatibility(served, reference) {
        candle_core::bail!("cannot compare the models layer by layer: {reason}");
    }
    let layers = served.config().num_layers;
    if let Some(n) = options.reference_until.filter(|&n| n >= layers) {
        candle_core::bail!("reference_until {n} is not a decoder layer (0..{layers})");
    }
    let lens: Vec<usize> = sequences.iter().map(|s| s.len()).collect();
    let spans = spans(&lens);
    let mut out: Vec<SequenceDiff> = sequences.iter().map(|_| SequenceDiff::default()).collect();
    let (mut xs, mut xr) = (served.embed(sequences)?, reference.embed(sequences)?);
    for i in 0..layers {
        boundary()?;
        xs = served.forward_layers(i..i + 1, xs, &lens)?;
        boundary()?;
        xr = reference.forward_layers(i..i + 1, xr, &lens)?;
        let errors: Vec<(f64, f64)> =
            position_sums(&served.residual(&xs)?, &reference.residual(&xr)?)?
                .into_iter()
                .map(position_error)
                .collect();
        for (seq, span) in out.iter_mut().zip(&spans) {
            let (cos_error, sqnr_db) = errors[span.clone()].iter().copied().unzip();
            seq.layers.push(LayerError { cos_error, sqnr_db });
        }
        if options.reference_until.is_some_and(|n| i <= n) {
            xs = crate::device::transfer(&xr.to_dtype(xs.dtype())?, xs.device())?;
        }
    }
    boundary()?;
    let hidden = served.final_norm(&xs)?;
    let reference_hidden = reference.final_norm(&xr)?;
    // Every attributed module's divergence compares with the same reference logits.
    let keep = !options.attribute.is_empty();
    let reference_logits =
        CachedLogits::new(reference, &reference_hidden, sequences, keep, boundary)?;
    let klds = kld_hidden(
        |rows| reference_logits.get(rows),
        |rows| {
            boundary()?;
            logits_on(served, &hidden, rows, None)
        },
        sequences,
        served.config().vocab_size,
    )?;
    for (seq, kld) in out.iter_mut().zip(klds) {
        seq.kld = kld;
    }
    if !options.attribute.is_empty() {
        let sums = attribution(
            served,
            reference,
            sequences,
            &reference_logits,
            &options.attribute,
            boundary,
        )?;
        for (s, seq) in out.iter_mut().enumerate() {
            seq.modules = sums.iter().map(|per_sequence| per_sequence[s]).collect();
        }
    }
    Ok(out)
}

/// `[module][sequence]`: Σ KLD over each sequence's positions of the reference with only that
/// module's weights replaced by the served model's dequantized ones. One reference pass; at
/// each layer that holds attributed modules, every one of them in turn runs from the layer's
/// input through the rest of the model.
fn attribution(
    served: &Model,
    reference: &Model,
    sequences: &[&[u32]],
    reference_logits: &CachedLogits,
    modules: &[String],
    boundary: &dyn Fn() -> Result<()>,
) -> Result<Vec<Vec<f64>>> {
    let lens: Vec<usize> = sequences.iter().map(|s| s.len()).collect();
    let vocab = reference.config().vocab_size;
    let reference_hidden = reference_logits.hidden;
    let mut sums = vec![Vec::new(); modules.len()];
    // The divergence of a run of the reference that ends in `hidden` (or in `head`'s logits).
    let kld_of = |hidden: &Tensor, head: Option<&QuantLinear>| -> Result<Vec<f64>> {
        let klds = kld_hidden(
            |rows| reference_logits.get(rows),
            |rows| {
                boundary()?;
                logits_on(reference, hidden, rows, head)
            },
            sequences,
            vocab,
        )?;
        Ok(klds.iter().map(SequenceKld::sum_kld).collect())
    };
    let mut by_layer: BTreeMap<usize, Vec<(usize, &str)>> = BTreeMap::new();
    for (m, name) in modules.iter().enumerate() {
        match split_module_name(name) {
            Some((layer, module)) => by_layer.entry(layer).or_default().push((m, module)),
            None => {
                // The lm_head: the reference's final states through the served head.
                let (dtype, device) = (reference_hidden.dtype(), reference_hidden.device());
                let head = transplant(served, name, dtype, device)?;
                sums[m] = kld_of(reference_hidden, Some(&head))?;
            }
        }
    }
    let Some(&last) = by_layer.keys().next_back() else {
        return Ok(sums);
    };
    let mut x = reference.embed(sequences)?;
    for i in 0..=last {
        x = to_layer(reference, i, x)?;
        for &(m, module) in by_layer.get(&i).into_iter().flatten() {
            boundary()?;
            let linear = transplant(served, &modules[m], x.dtype(), x.device())?;
            let mut y = reference.forward_layer_with(i, module, linear, x.clone(), &lens)?;
            // The rest one layer at a time, each a unit of work (the same kernels as a run of
            // several layers: only the boundaries are new).
            for j in i + 1..reference.config().num_layers {
                boundary()?;
                y = reference.forward_layers(j..j + 1, y, &lens)?;
            }
            sums[m] = kld_of(&reference.final_norm(&y)?, None)?;
        }
        boundary()?;
        x = reference.forward_layers(i..i + 1, x, &lens)?;
    }
    Ok(sums)
}

/// The reference's logits of its own final states, which every module's divergence compares
/// with: when asked, kept from the first computation if they fit [`CACHED_LOGITS_BYTES`] (on a
/// CPU they cost as much as the swapped run's own head), else computed each time.
struct CachedLogits<'a> {
    model: &'a Model,
    hidden: &'a Tensor,
    chunks: BTreeMap<usize, Tensor>,
}

/// The most reference logits attribution keeps (4 windows of 512 tokens with a 49k vocabulary
/// in f32 are 0.4 GB).
const CACHED_LOGITS_BYTES: usize = 1 << 30;

impl<'a> CachedLogits<'a> {
    fn new(
        model: &'a Model,
        hidden: &'a Tensor,
        sequences: &[&[u32]],
        keep: bool,
        boundary: &dyn Fn() -> Result<()>,
    ) -> Result<Self> {
        let vocab = model.config().vocab_size;
        let chunks = logit_chunks(sequences, vocab);
        let rows: usize = chunks.iter().map(|r| r.len()).sum();
        let mut cached = Self {
            model,
            hidden,
            chunks: BTreeMap::new(),
        };
        if keep && rows * vocab * hidden.dtype().size_in_bytes() <= CACHED_LOGITS_BYTES {
            for rows in chunks {
                boundary()?;
                let logits = logits_on(model, hidden, rows.clone(), None)?;
                cached.chunks.insert(rows.start, logits);
            }
        }
        Ok(cached)
    }

    fn get(&self, rows: Range<usize>) -> Result<Tensor> {
        match self.chunks.get(&rows.start) {
            Some(logits) if logits.dim(0)? == rows.len() => Ok(logits.clone()),
            _ => logits_on(self.model, self.hidden, rows, None),
        }
    }
}

/// `model`'s logits of rows `rows` of `hidden` on its device, through `head` when given.
fn logits_on(
    model: &Model,
    hidden: &Tensor,
    rows: Range<usize>,
    head: Option<&QuantLinear>,
) -> Result<Tensor> {
    let hidden = hidden.narrow(0, rows.start, rows.len())?;
    match head {
        Some(head) => model.logits_with(&hidden, head),
        None => model.logits(&hidden),
    }
}

/// Module `name` of the served model, its weight dequantized (on the served model's device,
/// where its kernels are) as a dense Linear in `dtype` on `device`, with its bias; without its
/// activation QDQ: only weights are swapped.
fn transplant(served: &Model, name: &str, dtype: DType, device: &Device) -> Result<QuantLinear> {
    let linear = served
        .linear(name)
        .ok_or_else(|| candle_core::Error::Msg(format!("the served model has no `{name}`")))?;
    let stage = match split_module_name(name) {
        Some((layer, _)) => served.layer_stage(layer),
        None => served.stage_count() - 1,
    };
    let own = served.stage_device(stage);
    let weight = profile::stage("transplant", own, || linear.weight().dequantize(dtype, own))?;
    let weight = crate::device::transfer(&weight, device)?;
    let bias = linear
        .bias()
        .map(|b| crate::device::transfer(&b.to_dtype(dtype)?, device))
        .transpose()?;
    Ok(QuantLinear::new(
        Box::new(DenseWeight::from_tensor(weight)),
        bias,
    ))
}

/// `x` on the device of `model`'s decoder layer `i`.
fn to_layer(model: &Model, i: usize, x: Tensor) -> Result<Tensor> {
    crate::device::transfer(&x, model.stage_device(model.layer_stage(i)))
}

/// Each sequence's rows in the concatenated batch.
fn spans(lens: &[usize]) -> Vec<Range<usize>> {
    lens.iter()
        .scan(0, |start, &len| {
            let span = *start..*start + len;
            *start += len;
            Some(span)
        })
        .collect()
}

/// Per position of two states `[rows, hidden]`: (Σ s·r, Σ s², Σ r², Σ (s − r)²), each in f64.
/// Computed where the states are (the smaller one, by dtype, is copied to the other's device
/// when they differ), so only these four numbers per position leave the device.
pub fn position_sums(served: &Tensor, reference: &Tensor) -> Result<Vec<[f64; 4]>> {
    let (s, r) = if served.device().same_device(reference.device()) {
        (served.clone(), reference.clone())
    } else if served.dtype().size_in_bytes() <= reference.dtype().size_in_bytes() {
        (
            crate::device::transfer(served, reference.device())?,
            reference.clone(),
        )
    } else {
        (
            served.clone(),
            crate::device::transfer(reference, served.device())?,
        )
    };
    profile::stage("compare", s.device(), || {
        let rows = s.dims2()?.0;
        let mut out = Vec::with_capacity(rows);
        for start in (0..rows).step_by(COMPARE_ROWS) {
            let len = COMPARE_ROWS.min(rows - start);
            out.extend(crate::ops::row_pair_sums(
                &s.narrow(0, start, len)?,
                &r.narrow(0, start, len)?,
            )?);
        }
        Ok(out)
    })
}

/// (cosine error, SQNR in dB) of one position from its [`position_sums`]. A zero state: cosine
/// error 0 against another zero state, 1 against anything else.
pub fn position_error([dot, served, reference, noise]: [f64; 4]) -> (f64, f64) {
    let norms = served * reference;
    let cos_error = if norms > 0.0 {
        1.0 - dot / norms.sqrt()
    } else if served == reference {
        0.0
    } else {
        1.0
    };
    let sqnr = if noise == 0.0 {
        SQNR_CAP_DB
    } else {
        (10.0 * (reference / noise).log10()).clamp(-SQNR_CAP_DB, SQNR_CAP_DB)
    };
    (cos_error, sqnr)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identical_states_have_no_error_and_the_capped_sqnr() {
        let (cos, sqnr) = position_error([4.0, 4.0, 4.0, 0.0]);
        assert_eq!((cos, sqnr), (0.0, SQNR_CAP_DB));
        assert_eq!(position_error([0.0, 0.0, 0.0, 0.0]), (0.0, SQNR_CAP_DB));
        // Against a zero reference any state is all noise.
        assert_eq!(position_error([0.0, 1.0, 0.0, 1.0]), (1.0, -SQNR_CAP_DB));
    }

    #[test]
    fn sums_and_errors_match_the_definitions() {
        let s = Tensor::new(
            &[[1.0f32, 2.0, 2.0], [0.0, 3.0, 4.0]],
            &candle_core::Device::Cpu,
        )
        .unwrap();
        let r = Tensor::new(
            &[[1.0f32, 2.0, 3.0], [0.0, 3.0, 4.0]],
            &candle_core::Device::Cpu,
        )
        .unwrap();
        let sums = position_sums(&s, &r).unwrap();
        assert_eq!(sums, vec![[11.0, 9.0, 14.0, 1.0], [25.0, 25.0, 25.0, 0.0]]);
        let (cos, sqnr) = position_error(sums[0]);
        assert!((cos - (1.0 - 11.0 / (9.0f64 * 14.0).sqrt())).abs() < 1e-15);
        assert!((sqnr - 10.0 * 14f64.log10()).abs() < 1e-12);
        assert_eq!(position_error(sums[1]), (0.0, SQNR_CAP_DB));
    }

    #[test]
    fn spans_cut_the_batch_by_sequence() {
        assert_eq!(spans(&[3, 1, 2]), vec![0..3, 3..4, 4..6]);
    }
}
