//! Launches of kernels/scoring.cu: fused scoring, the KL divergence of two models' rows, and
//! the per-row sums of two states. Only per-row numbers come back to the host.
// Kernel launches are FFI: the argument lists below must match the kernel signatures.

use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, DType, Result, Tensor};

use super::module::{kernel, SCORING, STORED_REFERENCE};
use super::{
    copy_to_host, grid_rows, kernel_name, rows_of_vectors, vector_kernel_name, with_slice, wrap,
};

/// Per row of two f32 states `[rows, cols]`: (Σ a·b, Σ a², Σ b², Σ (a − b)²) in f64.
pub fn row_pair_sums(a: &Tensor, b: &Tensor) -> Result<Vec<[f64; 4]>> {
    let (a, b) = (a.contiguous()?, b.contiguous()?);
    let (rows, cols) = a.dims2()?;
    if b.dims() != [rows, cols] || a.dtype() != DType::F32 || b.dtype() != DType::F32 {
        bail!("row_pair_sums needs two f32 [rows, cols] of one shape");
    }
    let sums = with_slice::<f32, _>(&a, |xs, xo, dev| {
        with_slice::<f32, _>(&b, |ys, yo, _| {
            let func = kernel(dev, &SCORING, "row_pair_sums")?;
            // SAFETY: the kernel writes every element.
            let out = unsafe { dev.alloc::<f64>(rows * 4) }?;
            let (xs, ys) = (xs.slice(xo..), ys.slice(yo..));
            let c32 = cols as i32;
            let mut builder = func.builder();
            builder.arg(&xs).arg(&ys).arg(&out).arg(&c32);
            // SAFETY: arguments match `row_pair_sums` (one 256-thread block per row).
            unsafe { builder.launch(grid_rows(rows)) }.w()?;
            Ok(wrap(out, dev, (rows, 4)))
        })
    })?;
    Ok(sums
        .to_vec2::<f64>()?
        .into_iter()
        .map(|v| [v[0], v[1], v[2], v[3]])
        .collect())
}

/// Fused log-softmax + gather + argmax + top-k over `logits` `[rows, vocab]`.
/// `targets[i] < 0` means row i has no target. The kernel writes all five vectors into one
/// device buffer, which comes back in one copy into a reused pinned host buffer: these words
/// are returned as they are (`ops::scoring` reads them).
pub fn score_rows(logits: &Tensor, targets: &[i32], top_k: usize) -> Result<Vec<u32>> {
    let logits = logits.contiguous()?;
    let (rows, vocab) = logits.dims2()?;
    if top_k > 20 {
        bail!("top_k {top_k} exceeds the kernel's maximum of 20");
    }
    // Layout of the buffer, 4-byte words: target logprob, argmax id, argmax logprob (one per
    // row each), then the top-k ids and logprobs (`rows * top_k` each).
    let top_len = rows * top_k;
    let words = 3 * rows + 2 * top_len;
    let vectors = rows_of_vectors(vocab, &[&logits]);
    let name = vector_kernel_name("score_rows", vectors, logits.dtype());
    with_float_type!(logits.dtype(), T => with_slice::<T, _>(&logits, |ls, lo, dev| {
        let func = kernel(dev, &SCORING, &name)?;
        let targets = dev.clone_htod(targets)?;
        // SAFETY: the kernel writes every word: three per row, and the top-k when k > 0.
        let out = unsafe { dev.alloc::<u32>(words.max(1)) }?;
        let part = |at: usize| out.slice(at..);
        let (tl, ai, al) = (part(0), part(rows), part(2 * rows));
        let (ti, tp) = (part(3 * rows), part(3 * rows + top_len));
        let ls = ls.slice(lo..);
        let (v32, k32) = (vocab as i32, top_k as i32);
        let mut b = func.builder();
        b.arg(&ls).arg(&v32).arg(&targets).arg(&k32).arg(&tl).arg(&ai).arg(&al).arg(&ti).arg(&tp);
        // SAFETY: arguments match `score_rows_*` (f32 and i32 outputs are 4-byte words here).
        unsafe { b.launch(grid_rows(rows)) }.w()?;
        copy_to_host(dev, &out.slice(0..words))
    }))
}

/// Fused KL-divergence of `logits` from `reference_logits` (both `[rows, vocab]`, same dtype and
/// device) per row, both ways, with both models' log p(target) and argmax, the top-K agreement
/// and the reference's top probability; see `kld_rows` in the kernels. One buffer of per-row
/// numbers comes back, never a vocabulary row: these words as they are (`ops::scoring` reads
/// them).
pub fn kld_rows(reference_logits: &Tensor, logits: &Tensor, targets: &[u32]) -> Result<Vec<u32>> {
    let (reference_logits, logits) = (reference_logits.contiguous()?, logits.contiguous()?);
    let (rows, vocab) = logits.dims2()?;
    if reference_logits.dtype() != logits.dtype() || targets.len() != rows {
        bail!(
            "kld_rows: {:?} reference logits, {:?} logits, {} targets for {rows} rows",
            reference_logits.dtype(),
            logits.dtype(),
            targets.len()
        );
    }
    // Layout, 4-byte words: three f64 vectors (two words a row each: the divergence, the
    // reverse divergence, the reference's top probability), then one word a row each: the
    // model's and the reference's log p(target), both argmax ids, the agreement mask.
    let words = 11 * rows;
    let name = kernel_name("kld_rows", logits.dtype());
    with_float_type!(logits.dtype(), T => with_slice::<T, _>(&reference_logits, |rs, ro, dev| {
        with_slice::<T, _>(&logits, |ls, lo, _| {
            let func = kernel(dev, &SCORING, &name)?;
            let targets: Vec<i32> = targets.iter().map(|&t| t as i32).collect();
            let targets = dev.clone_htod(&targets)?;
            // SAFETY: the kernel writes every word (thread 0 of each row's block).
            let out = unsafe { dev.alloc::<u32>(words.max(1)) }?;
            let part = |at: usize| out.slice(at * rows..);
            let (kld, reverse, ref_top_p) = (part(0), part(2), part(4));
            let (lp, rlp, top, rtop, agree) = (part(6), part(7), part(8), part(9), part(10));
            let (rs, ls) = (rs.slice(ro..), ls.slice(lo..));
            let v32 = vocab as i32;
            let mut b = func.builder();
            b.arg(&rs).arg(&ls).arg(&v32).arg(&targets);
            b.arg(&kld).arg(&reverse).arg(&ref_top_p);
            b.arg(&lp).arg(&rlp).arg(&top).arg(&rtop).arg(&agree);
            // SAFETY: arguments match `kld_rows_*`; the f64 parts start the (256-byte aligned)
            // buffer and span 8 bytes a row each, so their values are aligned.
            unsafe { b.launch(grid_rows(rows)) }.w()?;
            copy_to_host(dev, &out.slice(0..words))
        })
    }))
}

/// The largest stored-reference `k` the kernels (kernels/stored_reference.cu) take (their
/// shared-memory lists).
pub const STORED_MAX_K: usize = 4096;

/// Per row of `logits` `[rows, vocab]`: its `k` best ids, their log-probabilities and the
/// log-mass of the rest (`reference_rows` in the kernels), as 4-byte words: the ids and the
/// log-probabilities (`rows * k` each, f32 bits), then one tail word a row.
pub fn reference_rows(logits: &Tensor, k: usize) -> Result<Vec<u32>> {
    let logits = logits.contiguous()?;
    let (rows, vocab) = logits.dims2()?;
    if k == 0 || k > vocab.min(STORED_MAX_K) {
        bail!(
            "reference_rows: k {k} outside 1..={} (vocabulary {vocab})",
            vocab.min(STORED_MAX_K)
        );
    }
    let words = 2 * rows * k + rows;
    let name = kernel_name("reference_rows", logits.dtype());
    with_float_type!(logits.dtype(), T => with_slice::<T, _>(&logits, |ls, lo, dev| {
        let func = kernel(dev, &STORED_REFERENCE, &name)?;
        // SAFETY: the kernel writes every word: k ids and log-probabilities a row, one tail.
        let out = unsafe { dev.alloc::<u32>(words.max(1)) }?;
        let (ids, lps, tails) = (out.slice(0..), out.slice(rows * k..), out.slice(2 * rows * k..));
        let ls = ls.slice(lo..);
        let (v32, k32) = (vocab as i32, k as i32);
        let mut b = func.builder();
        b.arg(&ls).arg(&v32).arg(&k32).arg(&ids).arg(&lps).arg(&tails);
        // SAFETY: arguments match `reference_rows_*` (i32 and f32 outputs are 4-byte words).
        unsafe { b.launch(grid_rows(rows)) }.w()?;
        copy_to_host(dev, &out.slice(0..words))
    }))
}

/// The served model's side of a stored reference per row of `logits` `[rows, vocab]`
/// (`served_tail_rows` in the kernels) against `ids` (`rows * k`, distinct per row), with each
/// row's tail budget (`mass`, `cap`). 4-byte words: three f64 vectors (the stored tokens' log
/// q, `rows * k`; the tail's log-mass; the worst tail), then the log q(target) (f32 bits) and
/// the argmax of each row.
pub fn served_tail_rows(
    logits: &Tensor,
    ids: &[i32],
    k: usize,
    targets: &[i32],
    mass: &[f64],
    cap: &[f64],
) -> Result<Vec<u32>> {
    let logits = logits.contiguous()?;
    let (rows, vocab) = logits.dims2()?;
    if k == 0 || k > vocab || k > STORED_MAX_K || ids.len() != rows * k {
        bail!(
            "served_tail_rows: {} ids for {rows} rows of k {k} (vocabulary {vocab})",
            ids.len()
        );
    }
    if targets.len() != rows || mass.len() != rows || cap.len() != rows {
        bail!("served_tail_rows: one target, mass and cap a row ({rows} rows)");
    }
    let f64_words = 2 * (rows * k + 2 * rows);
    let words = f64_words + 2 * rows;
    let name = kernel_name("served_tail_rows", logits.dtype());
    with_float_type!(logits.dtype(), T => with_slice::<T, _>(&logits, |ls, lo, dev| {
        let func = kernel(dev, &STORED_REFERENCE, &name)?;
        let (ids, targets) = (dev.clone_htod(ids)?, dev.clone_htod(targets)?);
        let (mass, cap) = (dev.clone_htod(mass)?, dev.clone_htod(cap)?);
        // SAFETY: the kernel writes every word (the f64 vectors as two words each).
        let out = unsafe { dev.alloc::<u32>(words) }?;
        let part = |at: usize| out.slice(at..);
        let (lp, tail, worst) = (part(0), part(2 * rows * k), part(2 * rows * (k + 1)));
        let (tlp, top) = (part(f64_words), part(f64_words + rows));
        let ls = ls.slice(lo..);
        let (v32, k32) = (vocab as i32, k as i32);
        let mut b = func.builder();
        b.arg(&ls).arg(&v32).arg(&ids).arg(&k32).arg(&targets).arg(&mass).arg(&cap);
        b.arg(&lp).arg(&tail).arg(&worst).arg(&tlp).arg(&top);
        // SAFETY: arguments match `served_tail_rows_*`; the f64 vectors start the (256-byte
        // aligned) buffer at even word offsets, so their values are aligned.
        unsafe { b.launch(grid_rows(rows)) }.w()?;
        copy_to_host(dev, &out.slice(0..words))
    }))
}
