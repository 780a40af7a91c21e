//! `check`'s MLA row: the fused flash-input kernel (`ops::mla_flash_inputs`) against the
//! composition it replaced in `model::blocks::mla` (rope of the rotary parts, de-interleaved
//! first for DeepSeek's layout, concatenation, Mistral 4's query scales, zero padding), bit for
//! bit, on the head shapes of DeepSeek-V3 / Kimi K2, GLM-4.7-Flash and a small one.

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use exactscore_server::ops::{mla_flash_inputs, rope_rotate_half, MlaHeads};

use crate::bits_equal;

/// The unfused composition of q, k, v (the model's flash path before the kernel).
fn composed(
    q: &Tensor,
    kv: &Tensor,
    k_rot: &Tensor,
    positions: &Tensor,
    (cos, sin): (&Tensor, &Tensor),
    scale: Option<&Tensor>,
    h: MlaHeads,
) -> Result<(Tensor, Tensor, Tensor)> {
    let tokens = q.dims()[0];
    let rotate = |x: Tensor| -> Result<Tensor> {
        let heads = x.dims()[1];
        let x = match h.interleave {
            true => x
                .reshape((tokens, heads, h.rope / 2, 2))?
                .transpose(2, 3)?
                .contiguous()?
                .reshape((tokens, heads, h.rope))?,
            false => x.contiguous()?,
        };
        Ok(rope_rotate_half(&x, positions, cos, sin)?)
    };
    let pad = |x: Tensor| -> Result<Tensor> {
        let d = x.dims()[2];
        let zeros = Tensor::zeros((tokens, h.heads, h.width - d), x.dtype(), x.device())?;
        Ok(Tensor::cat(&[&x, &zeros], 2)?.contiguous()?)
    };
    let q = q.reshape((tokens, h.heads, h.nope + h.rope))?;
    let kv = kv.reshape((tokens, h.heads, h.nope + h.value))?;
    let q_rot = rotate(q.narrow(2, h.nope, h.rope)?)?;
    let k_rot =
        rotate(k_rot.reshape((tokens, 1, h.rope))?)?.broadcast_as((tokens, h.heads, h.rope))?;
    let mut q = Tensor::cat(&[&q.narrow(2, 0, h.nope)?, &q_rot], 2)?;
    if let Some(s) = scale {
        q = q.broadcast_mul(&s.reshape((tokens, 1, 1))?)?;
    }
    Ok((
        pad(q)?,
        pad(Tensor::cat(&[&kv.narrow(2, 0, h.nope)?, &k_rot], 2)?)?,
        pad(kv.narrow(2, h.nope, h.value)?)?,
    ))
}

/// Prints one line per case; returns the number of cases whose bits differ.
pub fn run(device: &Device) -> Result<usize> {
    println!("| MLA flash inputs (fused vs composed) | bitwise q / k / v | |");
    println!("|---|---|---|");
    let mut failures = 0;
    // (heads, nope, rope, value, width, interleave): DeepSeek-V3 / Kimi K2, GLM-4.7-Flash, small,
    // and parts not in whole 8-value chunks (the kernel's one-by-one copies)
    for (heads, nope, rope, value, width, interleave) in [
        (8, 128, 64, 128, 192, true),
        (5, 192, 64, 256, 256, false),
        (3, 32, 16, 24, 64, true),
        (4, 36, 12, 20, 64, false),
    ] {
        let h = MlaHeads {
            heads,
            nope,
            rope,
            value,
            width,
            interleave,
        };
        for scaled in [false, true] {
            let lens = [37usize, 1, 130];
            let tokens: usize = lens.iter().sum();
            let dtype = DType::BF16;
            let rand = |shape: (usize, usize)| -> Result<Tensor> {
                Ok(Tensor::randn(0f32, 1.0, shape, device)?.to_dtype(dtype)?)
            };
            let q = rand((tokens, heads * (nope + rope)))?;
            let kv = rand((tokens, heads * (nope + value)))?;
            let k_rot = rand((tokens, rope))?;
            let pos: Vec<i32> = lens.iter().flat_map(|&l| 0..l as i32).collect();
            let positions = Tensor::new(pos.as_slice(), device)?;
            let (cos, sin) = (rand((256, rope / 2))?, rand((256, rope / 2))?);
            let scale = match scaled {
                true => Some(Tensor::rand(0.5f32, 2.0, tokens, device)?.to_dtype(dtype)?),
                false => None,
            };
            let fused =
                mla_flash_inputs(&q, &kv, &k_rot, &positions, &cos, &sin, scale.as_ref(), h)?;
            let want = composed(&q, &kv, &k_rot, &positions, (&cos, &sin), scale.as_ref(), h)?;
            let same = [
                bits_equal(&fused.0, &want.0)?,
                bits_equal(&fused.1, &want.1)?,
                bits_equal(&fused.2, &want.2)?,
            ];
            let ok = same.iter().all(|&s| s);
            failures += usize::from(!ok);
            println!(
                "| {heads} heads, {nope} + {rope} / {value} in {width}{}{} | {} / {} / {} | {} |",
                if interleave { ", interleaved" } else { "" },
                if scaled { ", query scales" } else { "" },
                same[0],
                same[1],
                same[2],
                if ok { "ok" } else { "FAIL" }
            );
        }
    }
    Ok(failures)
}
